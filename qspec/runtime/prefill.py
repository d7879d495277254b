"""Prefill over a loaded model: write tokens into KV slots through the prefill shape, chunk by chunk,
a prompt's last few tokens through decode shapes when that is faster (:func:`chunk_shape`).

One routine for every caller that fills a cache: the engine (prompts into the target) and the draft
proposer (a backlog into the draft model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

OnLast = Callable[[int, np.ndarray], None]  # (row index, logits [1, vocab] after the row's last token)
# (row index, first position, hidden [n, hidden]): the final-norm hidden states of a chunk's n tokens
OnHidden = Callable[[int, int, np.ndarray], None]


@dataclass(frozen=True)
class PrefillRow:
    """Tokens to write into KV slot ``slot`` at positions ``start, start + 1, ...``."""

    slot: int
    tokens: Sequence[int]
    start: int = 0


def place_rows(model, bound, slots: Sequence[int]) -> list[int]:
    """The call row of each KV slot of ``slots`` in a call of ``bound``; sets its ``batch_index``.

    A call with a row per KV slot (no ``batch_index``, or as many rows as the cache has slots) runs each
    slot on its own row. A narrower one (a prefill shape of ``batch_size`` < ``full_batch_size``, a decode
    shape under ``kv_cache_batch_size``) gives the slots rows 0, 1, ... and points its padding rows at a
    slot no live row of the call writes (padding rewrites what a slot holds: nothing changes there).
    Example, 8 slots, 4 rows, slots ``[5, 2]``: rows ``[0, 1]``, ``batch_index`` ``[5, 2, 0, 0]``.
    """
    if bound.batch_index is None:
        return list(slots)
    rows = bound.spec.batch_size
    if rows == model.rows:
        bound.batch_index[:, 0] = np.arange(rows)
        return list(slots)
    used = set(slots)
    bound.batch_index[:, 0] = next((s for s in range(model.rows) if s not in used), 0)
    bound.batch_index[: len(slots), 0] = slots
    return list(range(len(slots)))


def _placed(model, bound, rows: list[tuple[int, PrefillRow]]) -> list[tuple[int, int]]:
    """(row of the call, row index) of every ``(index, row)`` in ``rows`` (:func:`place_rows`)."""
    return list(zip(place_rows(model, bound, [row.slot for _, row in rows]), (i for i, _ in rows)))


def chunk_shape(model, rows: int, rest: int) -> int | None:
    """The shape of the next prefill call for ``rows`` rows with at most ``rest`` tokens left: ``None``
    for the prefill shape, or K for the decode shape ``seq_len = K + 1``.

    A prompt's last tokens go through decode shapes when calls of one finish them sooner than one
    call of the prefill shape, judged by the calls timed at warm-up (:attr:`LoadedModel.call_ms`):
    a 66-token prompt with a 64-token prefill shape runs 64 + 2 tokens, not 64 + 64. Untimed models
    use the prefill shape, and so does a graph that runs live tokens only
    (:attr:`LoadedModel.packs_live_tokens`): there the prefill shape's padding costs nothing, and one
    call streams the weights once where several decode calls stream them each (a 40-token tail with
    256-token chunks, fp32: one call, not eight K=4 calls priced by a full chunk's time). The output
    does not change with the plan: every row's KV and logits are its own tokens' (the contract's
    padding semantics).
    """
    prefill = model.prefill.spec
    if rest >= prefill.seq_len or prefill not in model.call_ms or model.packs_live_tokens:
        return None
    best_k, best_ms = None, model.call_ms[prefill]
    for k, bound in sorted(model.decode.items()):
        spec = bound.spec
        if spec.batch_size < rows or spec not in model.call_ms:
            continue
        ms = math.ceil(rest / spec.seq_len) * model.call_ms[spec]
        if ms < best_ms:
            best_k, best_ms = k, ms
    return best_k


def run_prefill(model, rows: Sequence[PrefillRow], on_last: OnLast, on_hidden: OnHidden | None = None) -> int:
    """Write every row's tokens into its slot, chunk by chunk; returns the calls made.

    Chunks are the prefill ``seq_len``, the last one possibly a decode shape (:func:`chunk_shape`).
    Rows go ``batch_size`` per call under continuous batching (all in one call otherwise, each on
    its slot's row). ``on_last(i, logits)`` is called once per row, with the logits after row
    ``i``'s last token, as soon as the chunk holding it has run. Each chunk runs in the smallest
    compute-context-length bucket that holds its positions. ``on_hidden``, on a package with the
    ``hidden_states`` output, receives every chunk's hidden states (a draft head reads them).
    """
    indexed = list(enumerate(rows))
    per_call = model.prefill.spec.batch_size if model.prefill.batch_index is not None else len(indexed)
    calls = 0
    for at in range(0, len(indexed), per_call):
        group = indexed[at : at + per_call]
        longest = max(len(row.tokens) for _, row in group)
        offset = 0
        while offset < longest:
            k = chunk_shape(model, len(group), longest - offset)
            width = model.prefill.spec.seq_len if k is None else k + 1
            end = max(row.start + min(len(row.tokens), offset + width) for _, row in group)
            bound = model.prefill_for(end) if k is None else model.decode_for(k, end)
            placed = _placed(model, bound, group)
            bound.reset()
            for r, i in placed:
                piece = rows[i].tokens[offset : offset + width]
                position = rows[i].start + offset
                bound.input_ids[r, : len(piece)] = piece
                bound.position_ids[r, : len(piece)] = np.arange(position, position + len(piece))
            # [rows, num_logits_to_keep, vocab], right-aligned: [r, -1] follows row r's last real token
            logits = model.run(bound)
            calls += 1
            if on_hidden is not None and bound.hidden_states is not None:
                for r, i in placed:
                    piece = len(rows[i].tokens[offset : offset + width])
                    if piece:
                        on_hidden(i, rows[i].start + offset, bound.hidden_states[r, :piece])
            for r, i in placed:
                if offset < len(rows[i].tokens) <= offset + width:
                    on_last(i, logits[r, -1:])
            offset += width
    return calls
