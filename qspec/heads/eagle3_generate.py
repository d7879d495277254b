"""The target's greedy answers and its EAGLE-3 teacher rows in one pass: batched, left-padded, KV-cached.

Generating an answer already runs the target over every answer token, so the taps and greedy labels a
head learns from are read off the same forwards (``output_hidden_states``) instead of a second,
teacher-forced pass. Rows that finish (stop token or ``max_new_tokens``) leave the batch and its cache,
so a long answer does not keep the short ones computing. Per record: ``tokens`` = prompt + answer,
``taps [n, 3, H]`` fp16 and ``labels [n]``: the target's argmax after each answer position (and after the
last prompt token); inside the prompt, where the head is never scored, the prompt's own next token, which
spares the LM head over the prompt. The last token's row is zeros: nothing reads it (its label would
predict past the answer).

Batched fp32 forwards differ from batch-1 ones in the last bits, so an answer can part from what batch-1
greedy writes after a near tie; the labels stay the target's own argmax at every position it saw.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from qspec.heads.eagle3_data import write_shard

Progress = Callable[[str], None]


def greedy_with_taps(
    model, prompts: list[list[int]], taps: tuple[int, ...], *, stop_ids: list[int], max_new_tokens: int
) -> list[dict]:
    """Greedy answers of ``prompts`` (one left-padded batch) with their teacher rows: per prompt
    ``{"prompt_ids", "answer_ids", "taps", "labels"}`` (the answer ends with its stop token when it has one)."""
    import torch
    from transformers import DynamicCache

    width = max(map(len, prompts))
    ids = torch.tensor([[stop_ids[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(stop_ids)
    cache, live = DynamicCache(), torch.arange(len(prompts))
    rows: list[list[np.ndarray]] = [[] for _ in prompts]
    labels: list[list[np.ndarray]] = [[np.asarray(p[1:], np.int64)] for p in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        for step in range(max_new_tokens):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                output_hidden_states=True,
                logits_to_keep=1,
            )
            stacked = torch.stack([out.hidden_states[t] for t in taps], 2).half().numpy()  # [b, s, 3, H]
            token = out.logits[:, -1].argmax(-1)
            for slot, row in enumerate(live.tolist()):
                rows[row].append(stacked[slot, width - len(prompts[row]) :] if step == 0 else stacked[slot])
                labels[row].append(np.array([int(token[slot])]))
                answers[row].append(int(token[slot]))
            going = ~torch.isin(token, stops) & (step + 1 < max_new_tokens)
            if not going.any():
                break
            if not going.all():
                kept = going.nonzero().flatten()
                cache.batch_select_indices(kept)
                live, token, mask, positions = live[kept], token[kept], mask[kept], positions[kept]
            ids = token[:, None]
            mask = torch.cat((mask, torch.ones_like(ids)), 1)
            positions = positions[:, -1:] + 1
    return [_record(p, a, r, lab) for p, a, r, lab in zip(prompts, answers, rows, labels)]


def _record(prompt: list[int], answer: list[int], rows: list[np.ndarray], labels: list[np.ndarray]) -> dict:
    n = len(prompt) + len(answer)
    taps = np.concatenate(rows)[:n]
    label = np.concatenate(labels)[:n].astype(np.int32)
    if len(taps) < n:  # the last token was never fed back: its row stays zeros
        taps = np.concatenate((taps, np.zeros((n - len(taps), *taps.shape[1:]), taps.dtype)))
        label = np.concatenate((label, np.zeros(n - len(label), np.int32)))
    return {"prompt_ids": prompt, "answer_ids": answer, "taps": taps, "labels": label}


def write_generated_shards(
    model,
    prompts: list[list[int]],
    work: Path,
    name: str,
    *,
    taps: tuple[int, ...],
    stop_ids: list[int],
    max_new_tokens: int,
    batch: int = 32,
    shard: int = 64,
    progress: Progress | None = None,
) -> list[Path]:
    """``NAME-00000.npz`` shards (the format of :mod:`qspec.heads.eagle3_data`) of the greedy answers to
    ``prompts`` (token ids), ``shard`` prompts each, generated ``batch`` at a time (an answer is its
    record's ``tokens`` from ``answer_starts`` on). Existing shards are kept: a stopped run resumes there."""
    say = progress or (lambda message: None)
    paths, count = [], (len(prompts) + shard - 1) // shard
    for number, at in enumerate(range(0, len(prompts), shard)):
        path = work / f"{name}-{number:05d}.npz"
        paths.append(path)
        if path.is_file():
            continue
        chunk = prompts[at : at + shard]
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]))  # similar prompt lengths share a batch
        done: dict[int, dict] = {}
        for b in range(0, len(order), batch):
            picked = order[b : b + batch]
            records = greedy_with_taps(
                model, [chunk[i] for i in picked], taps, stop_ids=stop_ids, max_new_tokens=max_new_tokens
            )
            done |= dict(zip(picked, records))
        records = [done[i] for i in range(len(chunk))]
        write_shard(path, records)
        tokens = sum(len(r["answer_ids"]) for r in records)
        say(f"generated {name}: shard {number + 1}/{count}, {tokens} answer tokens")
    return paths
