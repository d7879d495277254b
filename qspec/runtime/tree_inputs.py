"""The vendor graph's tree inputs (``write_slots``, ``tree_mask``, ``kv_moves``), written from a call's positions.

A vendor graph exported with ``ExportOptions.tree_inputs`` (the ``qaic`` backend's, for K > 0) does not derive
the KV slot and the attention of a token from its position alone: siblings of a tree share a position
(:mod:`qspec.runtime.layout`), so ``CtxScatter`` by position would write both at one slot. The host writes,
before each call, from the call's ``position_ids`` only (the runtime graph derives the same from the positions,
:func:`qspec.backends.ort_attention_nodes.tree_inputs`):

- ``write_slots[b, t]``: the row's live tokens at consecutive slots from its first position (a chain: its
  positions; a tree ``[10, 11, 12, 11]``: slots ``10, 11, 12, 13``);
- ``tree_mask[b, s, t]``: token ``s`` sees itself and the row's chain tokens (the prefix at positions
  ``p, p + 1, ...``) at positions before its own; on a chain, the lower triangle;
- ``kv_moves[b, j]``: ``(from, to)`` slot copies of the row's KV the graph makes before the call writes
  (an accepted draft off the chain to its depth's slot, :meth:`~qspec.runtime.layout.VerifyLayout.moves`);
  a row without moves copies slot 0 onto itself.

Example, a row at positions ``[10, 11, 12, 11, -1]`` (chain ``a b``, ``c`` beside ``a``, one padding token):
``write_slots`` ``[10, 11, 12, 13, 0]``; ``c`` (token 3) sees tokens 0 and 3, ``b`` tokens 0, 1, 2.
"""

from __future__ import annotations

import numpy as np

from qspec import contract


def tree_arrays(rows: int, seq: int) -> dict[str, np.ndarray]:
    """Zeroed tree inputs of a ``[rows, seq]`` call: ``{input name: array}``."""
    return {
        contract.WRITE_SLOTS: np.zeros((rows, seq), np.int64),
        contract.TREE_MASK: np.zeros((rows, seq, seq), np.bool_),
        contract.KV_MOVES: np.zeros((rows, seq, 2), np.int64),
    }


def write_tree_inputs(position_ids: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
    """``write_slots`` and ``tree_mask`` of every row from its positions (module doc); chains take a fast path."""
    slots, mask = arrays[contract.WRITE_SLOTS], arrays[contract.TREE_MASK]
    valid = position_ids >= 0
    steps = np.arange(position_ids.shape[1])
    chain = np.all((np.diff(position_ids, axis=1) == 1) | ~valid[:, 1:])
    if chain and np.all(valid[:, :1] | ~valid.any(axis=1, keepdims=True)):  # left-aligned chains: as positions
        np.copyto(slots, np.where(valid, position_ids, 0))
        mask[:] = steps[None, :] <= steps[:, None]
        return
    for row, positions in enumerate(position_ids):
        live = np.flatnonzero(positions >= 0)
        slots[row] = 0
        mask[row] = steps[None, :] <= steps[:, None]
        if not live.size:
            continue
        first = positions[live[0]]
        slots[row, live] = first + np.arange(live.size)
        on_chain = np.zeros(positions.shape[0], np.bool_)
        on_chain[live] = np.cumprod(positions[live] == first + np.arange(live.size)).astype(np.bool_)
        sees = on_chain[None, :] & (positions[None, :] < positions[:, None])
        mask[row, live] = (sees | np.eye(positions.shape[0], dtype=np.bool_))[live]  # padding queries: the triangle


def write_moves(kv_moves: np.ndarray, moves: list[list[tuple[int, int]]]) -> None:
    """``kv_moves`` of each call row from its ``(from, to)`` slot copies; the rest of a row repeats its last copy
    (the same value written twice), a row without copies copies slot 0 onto itself."""
    kv_moves[:] = 0
    for row, copies in enumerate(moves):
        if copies:
            kv_moves[row, :] = copies[-1]
            kv_moves[row, : len(copies)] = copies
