"""Prefill over a loaded model: write tokens into KV slots through the prefill shape, chunk by chunk.

One routine for every caller that fills a cache: the engine (prompts into the target) and the draft
proposer (a backlog into the draft model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

OnLast = Callable[[int, np.ndarray], None]  # (row index, logits [1, vocab] after the row's last token)


@dataclass(frozen=True)
class PrefillRow:
    """Tokens to write into KV slot ``slot`` at positions ``start, start + 1, ...``."""

    slot: int
    tokens: Sequence[int]
    start: int = 0


def _placed(model, bound, rows: list[tuple[int, PrefillRow]]) -> list[tuple[int, int]]:
    """(row of the prefill call, row index); sets ``bound.batch_index`` under continuous batching."""
    if bound.batch_index is None:  # one KV row per call row: a row's call row is its slot
        return [(row.slot, i) for i, row in rows]
    used = {row.slot for _, row in rows}
    spare = next((s for s in range(model.rows) if s not in used), 0)
    # Padding rows point at a slot no live row of this call writes (they rewrite its old values).
    bound.batch_index[:, 0] = spare
    for r, (_, row) in enumerate(rows):
        bound.batch_index[r, 0] = row.slot
    return [(r, i) for r, (i, _) in enumerate(rows)]


def run_prefill(model, rows: Sequence[PrefillRow], on_last: OnLast) -> int:
    """Write every row's tokens into its slot in chunks of the prefill ``seq_len``; returns the calls made.

    Rows go ``batch_size`` per call under continuous batching (all in one call otherwise, each on
    its slot's row). ``on_last(i, logits)`` is called once per row, with the logits after row
    ``i``'s last token, as soon as the chunk holding it has run. Each chunk runs in the smallest
    compute-context-length bucket that holds its positions.
    """
    chunk = model.prefill.spec.seq_len
    indexed = list(enumerate(rows))
    per_call = model.prefill.spec.batch_size if model.prefill.batch_index is not None else len(indexed)
    calls = 0
    for at in range(0, len(indexed), per_call):
        group = indexed[at : at + per_call]
        longest = max(len(row.tokens) for _, row in group)
        for offset in range(0, longest, chunk):
            end = max(row.start + min(len(row.tokens), offset + chunk) for _, row in group)
            bound = model.prefill_for(end)
            placed = _placed(model, bound, group)
            bound.reset()
            for r, i in placed:
                piece = rows[i].tokens[offset : offset + chunk]
                position = rows[i].start + offset
                bound.input_ids[r, : len(piece)] = piece
                bound.position_ids[r, : len(piece)] = np.arange(position, position + len(piece))
            logits = model.run(bound)  # [rows, 1, vocab]: the last real token of each row
            calls += 1
            for r, i in placed:
                if offset < len(rows[i].tokens) <= offset + chunk:
                    on_last(i, logits[r, :1])
    return calls
