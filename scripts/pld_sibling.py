"""Would prompt lookup's second candidate pay as a tree sibling? Replays greedy outputs a bench recorded (token
ids, no model call): at every step with drafts, when the chosen continuation's first draft is wrong, is another
match's continuation (the longest n-gram first, the most recent match whose next token differs) the greedy token?

    python scripts/pld_sibling.py docs/bench/heads-7/make-bench-2.json PACKAGE/tokenizer [--config none@4]
        [--min 1 --max 3 --k 4]

The prompts are the MT-bench first turns the bench ran, through the package's chat template.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from qspec.prompts import default_prompts_path
from qspec.runtime.proposers import PromptLookup
from qspec.runtime.tokenizer import Tokenizer


def second_candidate(look: PromptLookup, first: int) -> int | None:
    """The next token of the most recent match (longest n-gram first) that does not continue with ``first``."""
    last = len(look.tokens) - 1
    for n in range(min(look.max_n, last), look.min_n - 1, -1):
        for end in reversed(look._ends[tuple(look.tokens[last - n + 1 :])][:-1]):
            if look.tokens[end + 1] != first:
                return look.tokens[end + 1]
    return None


def replay(prompt: list[int], output: list[int], counts: Counter, *, min_n: int, max_n: int, k: int) -> None:
    """One request's steps as greedy prompt lookup takes them (all of a step's right drafts, then the bonus)."""
    look = PromptLookup(min_n, max_n)
    look.extend(prompt)
    i = 0
    while i < len(output):
        drafts, _ = look.propose_match(k)
        accepted = 0
        while accepted < len(drafts) and i + accepted < len(output) and drafts[accepted] == output[i + accepted]:
            accepted += 1
        counts["steps"] += 1
        counts["steps with drafts"] += len(drafts) > 0
        if len(drafts) and not accepted:
            counts["first draft wrong"] += 1
            alternative = second_candidate(look, int(drafts[0]))
            counts["a second candidate"] += alternative is not None
            counts["the second candidate right"] += alternative == output[i]
        look.extend(output[i : i + accepted + 1])
        i += accepted + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("tokenizer")
    parser.add_argument("--config", default="none@4")
    parser.add_argument("--min", type=int, default=1)
    parser.add_argument("--max", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    outputs = json.loads(open(args.report).read())["outputs"][args.config]
    tokenizer = Tokenizer(args.tokenizer)
    rows = [json.loads(line) for line in default_prompts_path().read_text().splitlines() if line.strip()]
    turns = {str(row["question_id"]): row["turns"][0] for row in rows}
    counts: Counter = Counter()
    for request, output in outputs.items():
        prompt = tokenizer.encode_prompt([{"role": "user", "content": turns[request]}], chat=True)
        replay(prompt, output, counts, min_n=args.min, max_n=args.max, k=args.k)
    wrong = counts["first draft wrong"]
    summary = dict(counts) | {
        "requests": len(outputs),
        "second right / first wrong": round(counts["the second candidate right"] / max(wrong, 1), 3),
        "steps saved at most": round(counts["the second candidate right"] / max(counts["steps"], 1), 3),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
