"""Chat data the target writes itself (the idea published as Magpie), answered by the target.

**Requests.** The chat template rendered up to the start of a user turn (system prompt included) is fed
to the target, which samples what a user would say next until its end-of-turn token. For SmolLM2::

    <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\\n<|im_start|>user\\n
    -> "What are some tips for writing a good cover letter?<|im_end|>"

**Answers.** Every request (Magpie's, or any chat prompt) is answered greedily by the same model, many
prompts a call, left-padded: the target's own greedy output is what a draft head must predict.

Both phases append to JSON-lines files a batch at a time and skip what is there, so a stopped run
resumes. MT-bench is evaluation data: :func:`mt_bench_guard` drops any training text that shares an
8-word run with an MT-bench question (:func:`keep_training_text`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from qspec.errors import ConfigError

Progress = Callable[[str], None]
SENTINEL = "\x00qspec-magpie\x00"  # stands for the user's text while the template is rendered
GUARD_WORDS = 8  # an 8-word run shared with MT-bench marks a text as MT-bench's


# MT-bench guard ----------------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _runs(text: str, n: int = GUARD_WORDS) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def mt_bench_guard() -> set[tuple[str, ...]]:
    """Every 8-word run of every MT-bench question turn (``qspec/data/mt_bench/question.jsonl``)."""
    path = Path(__file__).resolve().parents[1] / "data" / "mt_bench" / "question.jsonl"
    runs: set[tuple[str, ...]] = set()
    for line in path.read_text().splitlines():
        if line.strip():
            for turn in json.loads(line)["turns"]:
                runs |= _runs(turn)
    return runs


def keep_training_text(text: str, guard: set[tuple[str, ...]]) -> bool:
    """False for text that quotes MT-bench (an 8-word run in common). Example: the first question of
    MT-bench, "Compose an engaging travel blog post about a recent trip to Hawaii, ..." -> False."""
    return not (_runs(text) & guard)


def screen_prompts(prompts: list[list[dict]], guard: set[tuple[str, ...]]) -> list[list[dict]]:
    """The prompts none of whose messages quote MT-bench."""
    return [p for p in prompts if all(keep_training_text(m["content"], guard) for m in p)]


# Files --------------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _append(path: Path, records: list[dict]) -> None:
    with path.open("a") as sink:
        for record in records:
            sink.write(json.dumps(record) + "\n")


# Requests -----------------------------------------------------------------------------------------------


def request_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's text begins (system prompt included)."""
    text = tokenizer.render_chat([{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    if SENTINEL not in text:
        raise ConfigError("the chat template does not place the user's text; Magpie requests need a chat model")
    return tokenizer.encode(text.split(SENTINEL)[0], add_special_tokens=False)


def clean_request(text: str) -> str | None:
    """A sampled request as a prompt, or None when it is unusable (too short, too long, or not words)."""
    text = text.strip()
    words = text.split()
    if not 3 <= len(words) <= 120 or sum(c.isalpha() for c in text) < len(text) / 2:
        return None
    return text


def write_requests(
    model,
    tokenizer,
    count: int,
    output: Path,
    *,
    stop_ids: list[int],
    batch: int = 32,
    max_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[dict]:
    """``count`` requests ``{"prompt": text, "batch": b}`` the model samples after :func:`request_prefix`,
    appended to ``output``; batch ``b`` is sampled with seed ``seed + b``, so a resumed run continues the
    same sequence. Unfinished, unusable, repeated and MT-bench-quoting requests are dropped."""
    import torch

    say = progress or (lambda message: None)
    done = read_jsonl(output)
    seen = {r["prompt"] for r in done}
    guard = mt_bench_guard()
    prefix = torch.tensor([request_prefix(tokenizer)])
    next_batch = max((r["batch"] for r in done), default=-1) + 1
    last = next_batch + 4 * (count - len(done) + batch - 1) // batch + 4  # a model that never ends a request
    while len(done) < count and next_batch < last:
        torch.manual_seed(seed + next_batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=prefix.expand(batch, -1),
                attention_mask=torch.ones(batch, prefix.shape[1], dtype=torch.long),
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_tokens,
                eos_token_id=stop_ids,
                pad_token_id=stop_ids[0],
            )
        records = []
        for row in out[:, prefix.shape[1] :].tolist():
            if not any(t in stop_ids for t in row):
                continue  # cut off: not a whole request
            text = clean_request(tokenizer.decode(row[: next(i for i, t in enumerate(row) if t in stop_ids)]))
            if text and text not in seen and keep_training_text(text, guard):
                seen.add(text)
                records.append({"prompt": text, "batch": next_batch})
        _append(output, records[: count - len(done)])
        done += records[: count - len(done)]
        next_batch += 1
        say(f"requests {len(done)}/{count}")
    if len(done) < count:
        say(f"only {len(done)} of {count} requests were usable after {next_batch} batches")
    return done


# Answers ------------------------------------------------------------------------------------------------


def encode_prompts(
    tokenizer, prompts: list[list[dict]], *, max_prompt_tokens: int = 768, screen: bool = True
) -> list[list[int]]:
    """The chat-template token ids of ``prompts``, without those over ``max_prompt_tokens`` and (``screen``)
    those that quote MT-bench."""
    guard = mt_bench_guard() if screen else set()
    encoded = [tokenizer.encode(tokenizer.render_chat(p), add_special_tokens=False) for p in prompts]
    return [e for e, p in zip(encoded, prompts) if len(e) <= max_prompt_tokens and screen_prompts([p], guard)]


def write_answers(
    model,
    tokenizer,
    prompts: list[list[dict]],
    output: Path,
    *,
    stop_ids: list[int],
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 768,
    batch: int = 16,
    screen: bool = True,
    progress: Progress | None = None,
) -> list[dict]:
    """Greedy answers ``{"prompt_ids", "answer_ids"}`` of ``model`` to ``prompts`` (MT-bench-quoting ones and
    those over ``max_prompt_tokens`` dropped first), appended to ``output`` ``batch`` prompts a call
    (left-padded); a resumed run skips the prompts already answered. The answer ends with its stop token.
    ``screen=False`` keeps MT-bench prompts: only for the evaluation set, written outside the training files."""
    import torch

    say = progress or (lambda message: None)
    done = read_jsonl(output)
    encoded = encode_prompts(tokenizer, prompts, max_prompt_tokens=max_prompt_tokens, screen=screen)
    for at in range(len(done), len(encoded), batch):
        chunk = encoded[at : at + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[stop_ids[0]] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop_ids,
                pad_token_id=stop_ids[0],
            )
        records = [
            {"prompt_ids": c, "answer_ids": next((row[: i + 1] for i, t in enumerate(row) if t in stop_ids), row)}
            for c, row in zip(chunk, out[:, width:].tolist())
        ]
        _append(output, records)
        done += records
        say(f"answers {len(done)}/{len(encoded)}, {sum(len(r['answer_ids']) for r in done)} tokens")
    return done
