"""`make demo`'s measurement: each speculative method on the prompt where it pays, beside `none` on the same
prompt, in one process, the runs interleaved (none, method, method, none, ...), the median of each.

    python scripts/demo.py packages/smollm2-k0_1_2_4-eagle [--max-new-tokens 256] [--runs 3]

Prints the method's answer, then one line per case: tokens/s of each, the speedup, and whether the output
is the same tokens as `none`'s (it must be: drafts never change greedy output).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from qspec.head_manifest import has_head
from qspec.runtime import Engine, SamplingParams

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# method, prompt file, why it pays there
CASES = [
    ("pld", "code_edit.txt", "prompt lookup on a code edit: the answer repeats the prompt's code"),
    ("eagle", "chat.txt", "the EAGLE head on a chat question: drafts from the model's own hidden states"),
]


def measure(none: Engine, engine: Engine, ids: list[int], params: SamplingParams, runs: int):
    """``(tok/s of none, tok/s of the method, the method's output, same as none)``: medians, interleaved."""
    rates: dict[str, list[float]] = {"none": [], "method": []}
    outputs = {}
    for run in range(runs):
        order = [("none", none), ("method", engine)]
        for name, eng in order if run % 2 == 0 else order[::-1]:
            outputs[name] = eng.generate([ids], params)[0]
            rates[name].append(eng.last_metrics.output_tokens_per_s)
    same = outputs["none"].token_ids == outputs["method"].token_ids
    return statistics.median(rates["none"]), statistics.median(rates["method"]), outputs["method"], same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    none = Engine(args.package, method="none")
    lines = []
    for method, prompt_file, why in CASES:
        if method == "eagle" and not has_head(args.package):
            continue
        ids = none.tokenizer.encode_chat((EXAMPLES / prompt_file).read_text())
        engine = Engine(args.package, method=method)
        base, rate, output, same = measure(none, engine, ids, params, args.runs)
        del engine
        print(f"== {method}: {why} (examples/{prompt_file}) ==\n{output.text}\n")
        lines.append(
            f"{method:>6} on {prompt_file:<14} {rate:6.1f} tokens/s, none {base:6.1f}: {rate / base:.2f}x "
            f"({output.metrics.mean_accepted_tokens:.2f} tokens per call; same tokens as none: "
            f"{'yes' if same else 'NO'})"
        )
    print(f"== measured here: median of {args.runs} interleaved runs, {args.max_new_tokens} tokens at most ==")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
