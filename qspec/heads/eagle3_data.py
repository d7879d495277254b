"""Teacher features for EAGLE-3: the target's residual stream at three taps, computed in torch.

A tap at layer id ``i`` is the residual stream entering decoder layer ``i``: Hugging Face's
``output_hidden_states[i]`` (0 = the embeddings), what vLLM's ``llama.py`` collects for
``eagle_aux_hidden_state_layer_ids``. vLLM's default ids for ``L`` layers are ``(2, L // 2, L - 3)``:
(2, 15, 27) for SmolLM2's 30. Beside the taps, each position keeps its token and the target's greedy
next token (``argmax`` of its logits), the label the head learns.

Records (``{"prompt_ids", "answer_ids"}``, :mod:`qspec.heads.magpie`) are written in shards of
``shard`` records: ``NAME-00000.npz`` holds ``taps [positions, 3, H]`` fp16, ``tokens``, ``labels``
``[positions]`` int32, ``starts [records + 1]`` and ``answer_starts [records]``. A shard is written
whole (temp file, then rename) and skipped when present, so a stopped run resumes at its shard.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from qspec.errors import ConfigError

Progress = Callable[[str], None]


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 tap ids. Example: 30 layers -> (2, 15, 27)."""
    return (2, num_layers // 2, num_layers - 3)


def check_taps(taps: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    if len(taps) != 3 or any(not 0 <= t < num_layers for t in taps):
        raise ConfigError(f"taps {list(taps)}: give three layer ids in [0, {num_layers})")
    return tuple(int(t) for t in taps)


def teacher_rows(model, sequences: list[list[int]], taps: tuple[int, ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence ``(taps [n, 3, H] fp16, labels [n] int32)``: one right-padded forward of them all."""
    import torch

    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    stacked = torch.stack([out.hidden_states[t] for t in taps], 2).half().numpy()  # [B, T, 3, H]
    labels = out.logits.argmax(-1).int().numpy()
    return [(stacked[row, : len(seq)], labels[row, : len(seq)]) for row, seq in enumerate(sequences)]


def shard_paths(work: Path, name: str) -> list[Path]:
    return sorted(work.glob(f"{name}-[0-9][0-9][0-9][0-9][0-9].npz"))


def write_teacher_shards(
    model,
    records: list[dict],
    work: Path,
    name: str,
    *,
    taps: tuple[int, ...],
    shard: int = 64,
    batch: int = 8,
    max_tokens: int = 1024,
    progress: Progress | None = None,
) -> list[Path]:
    """Teacher shards of ``records`` (each cut to ``max_tokens``) in ``work``; existing shards are kept."""
    say = progress or (lambda message: None)
    paths = []
    for number, at in enumerate(range(0, len(records), shard)):
        path = work / f"{name}-{number:05d}.npz"
        paths.append(path)
        if path.is_file():
            continue
        chunk = records[at : at + shard]
        seqs = [(r["prompt_ids"] + r["answer_ids"])[:max_tokens] for r in chunk]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths share a forward
        rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for b in range(0, len(order), batch):
            picked = order[b : b + batch]
            rows |= dict(zip(picked, teacher_rows(model, [seqs[i] for i in picked], taps)))
        cuts = [min(len(r["prompt_ids"]), len(seq)) for r, seq in zip(chunk, seqs)]  # the prompt's share of a cut seq
        write_shard(
            path,
            [
                {"prompt_ids": seq[:cut], "answer_ids": seq[cut:], "taps": rows[i][0], "labels": rows[i][1]}
                for i, (seq, cut) in enumerate(zip(seqs, cuts))
            ],
        )
        say(f"teacher {name}: shard {number + 1}/{(len(records) + shard - 1) // shard}")
    return paths


def write_shard(path: Path, records: list[dict]) -> None:
    """One shard of ``records`` (``prompt_ids``, ``answer_ids``, ``taps``, ``labels``), written whole or not at all."""
    lengths = np.array([len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records])
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        taps=np.concatenate([r["taps"] for r in records]),
        labels=np.concatenate([r["labels"] for r in records]),
        tokens=np.concatenate([np.asarray(list(r["prompt_ids"]) + list(r["answer_ids"]), np.int32) for r in records]),
        starts=starts,
        answer_starts=starts[:-1] + np.array([len(r["prompt_ids"]) for r in records], np.int64),
    )
    tmp.rename(path)


def load_shards(paths: list[Path]) -> dict:
    """Shards as one table (same keys, offsets shifted)."""
    if not paths:
        raise ConfigError("no teacher shards to train on; run the data phases first")
    parts = [dict(np.load(p)) for p in paths]
    out = {key: np.concatenate([p[key] for p in parts]) for key in ("taps", "labels", "tokens")}
    starts, answers, offset = [np.zeros(1, np.int64)], [], 0
    for p in parts:
        starts.append(p["starts"][1:] + offset)
        answers.append(p["answer_starts"] + offset)
        offset += int(p["starts"][-1])
    out["starts"], out["answer_starts"] = np.concatenate(starts), np.concatenate(answers)
    return out


def record_count(data: dict) -> int:
    return len(data["starts"]) - 1


def record(data: dict, i: int) -> dict:
    """Record ``i``: ``taps``, ``labels``, ``tokens`` and ``answer`` (offset where its answer starts)."""
    lo, hi = int(data["starts"][i]), int(data["starts"][i + 1])
    return {
        "taps": data["taps"][lo:hi],
        "labels": data["labels"][lo:hi],
        "tokens": data["tokens"][lo:hi],
        "answer": int(data["answer_starts"][i]) - lo,
    }
