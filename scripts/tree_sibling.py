"""What a width-2 tree at depth 1 would verify, measured on chain runs: how often the EAGLE head's runner-up for
the first draft is the target's token when the head's top-1 is not, and the tokens per call of a tree against the
chain at equal call size. No tree is verified: the run is the chain's (greedy, so its output is `none`'s); at each
step the head's two best tokens at depth 1 are kept and compared with the token the target emitted first.

    python scripts/tree_sibling.py packages/smollm2-k0_1_2_4-eagle [--prompts 8] [--max-new-tokens 64]

Per step with ``n >= 1`` drafts, ``a`` accepted (tokens ``1 + a``): the tree of the same call size keeps the chain's
first ``n - 1`` drafts and the sibling (``1 + min(a, n - 1) + hit``, ``hit``: the first draft failed and the runner-up
is the target's token); the tree one slot wider keeps all ``n`` (``1 + a + hit``). Tokens per call and sibling
acceptance do not depend on the machine's load; times do (none here).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from qspec.prompts import default_prompts_path, load_prompts
from qspec.runtime import Engine, SamplingParams
from qspec.runtime.heads import EagleProposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package")
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench first turns, one per category first")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dispatch", default="cover")
    args = parser.parse_args()

    runner_up: dict[int, tuple[int, float]] = {}  # id(head request) -> (second-best token, its probability)
    take = EagleProposer._take

    def recording_take(self, row, logits, feature):
        if not row.drafts:
            order = np.argsort(logits)[::-1][:2]
            x = logits.astype(np.float64)
            probs = np.exp(x - x.max())
            probs /= probs.sum()
            second = int(self.to_target(order[1:2])[0])
            runner_up[id(row.request)] = (second, float(probs[order[1]]))
        take(self, row, logits, feature)

    EagleProposer._take = recording_take
    engine = Engine(args.package, method="eagle", dispatch=args.dispatch)
    steps = []  # (drafts, accepted, first draft failed, runner-up hit, runner-up probability)
    accept = engine.accept

    def recording_accept(seq, proposal, logits):
        path, tokens = accept(seq, proposal, logits)
        if len(proposal):
            second, prob = runner_up.get(id(engine.proposer._requests[seq.index]), (-1, 0.0))
            failed = int(proposal.tokens[0]) != tokens[0]
            steps.append((len(proposal), len(path), failed, failed and second == tokens[0], prob))
        return path, tokens

    engine.accept = recording_accept
    records = load_prompts(default_prompts_path(), per_category=1)[: args.prompts]
    prompts = [[{"role": "user", "content": record.turns[0]}] for record in records]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for prompt in prompts:  # batch 1
        engine.generate([prompt], params, chat=True)
    drafts, accepted, failed, hit, prob = (np.array(column) for column in zip(*steps))
    chain = 1 + accepted
    same_size = np.where(drafts >= 2, 1 + np.minimum(accepted, drafts - 1) + hit, chain)
    wider = chain + hit
    print(
        json.dumps(
            {
                "package": args.package,
                "prompts": len(prompts),
                "max_new_tokens": args.max_new_tokens,
                "dispatch": args.dispatch,
                "steps_with_drafts": len(steps),
                "mean_drafts": round(float(drafts.mean()), 3),
                "first_draft_failed": int(failed.sum()),
                "sibling_hits": int(hit.sum()),
                "sibling_acceptance_when_tried": round(float(hit.sum() / max(failed.sum(), 1)), 3),
                "runner_up_probability_mean": round(float(prob[failed].mean()) if failed.any() else 0.0, 3),
                "tokens_per_call_chain": round(float(chain.mean()), 3),
                "tokens_per_call_tree_same_size": round(float(same_size.mean()), 3),
                "tokens_per_call_tree_one_slot_wider": round(float(wider.mean()), 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
