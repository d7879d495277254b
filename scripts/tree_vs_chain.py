"""Trees against chains on one package, greedy, batch 1: the EAGLE head's chain (``tree_width`` 1) and the chain
plus its runner-up for the first draft (``tree_width`` 2), prompt by prompt in turn on one loaded model (a slow
stretch of a shared machine lands on both), outputs checked equal.

    python scripts/tree_vs_chain.py packages/smollm2-k0_1_2_4-eagle [--prompts 8] [--max-new-tokens 64]
        [--num-speculative-tokens 0,1,2,4] [--dispatch cover] [--threshold 0.5]

Per configuration: tokens per verify call (the first token, from prefill, not counted), ms per verify call
(median of the prompts' means), live tokens per call, and for the tree the sibling's acceptance when the first
draft failed. Tokens per call and acceptance do not depend on the machine's load; ms do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from qspec.prompts import default_prompts_path, load_prompts
from qspec.runtime import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", default=None)
    parser.add_argument("--dispatch", default="cover")
    parser.add_argument("--threshold", type=float, default=None, help="the head's draft_confidence_threshold")
    args = parser.parse_args()
    common = dict(method="eagle", dispatch=args.dispatch, num_speculative_tokens=args.num_speculative_tokens)
    common["draft_confidence_threshold"] = args.threshold
    chain = Engine(args.package, tree_width=1, **common)
    tree = Engine(args.package, model=chain.model, tree_width=2, **common)
    records = load_prompts(default_prompts_path(), per_category=1)[: args.prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    stats = {"chain": [], "tree": []}
    for record in records:
        prompt = [{"role": "user", "content": record.turns[0]}]
        outputs = {}
        for name, engine in (("chain", chain), ("tree", tree)):
            [out] = engine.generate([prompt], params, chat=True)
            metrics = engine.last_metrics
            calls = sum(n for k, n in metrics.calls.items() if k != "prefill")
            stats[name].append((len(out.token_ids) - 1, calls, metrics.seconds["decode"] * 1000, metrics.proposed))
            outputs[name] = out.token_ids
        assert outputs["chain"] == outputs["tree"], f"outputs differ on {record.id}"
    report = {"package": args.package, "load_average": os.getloadavg()[0], **vars(args)}
    for name, rows in stats.items():
        tokens, calls, ms, proposed = (sum(column) for column in zip(*rows))
        report[name] = {
            "tokens_per_call": round(tokens / calls, 3),
            "live_tokens_per_call": round((calls + proposed) / calls, 3),
            "ms_per_call_median": round(statistics.median(r[2] / r[1] for r in rows), 2),
        }
    siblings = tree.dispatcher.siblings
    report["tree"]["sibling_accepted_when_tried"] = f"{siblings.passed}/{siblings.tried}"
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
