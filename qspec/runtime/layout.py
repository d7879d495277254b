"""The verify layout of one row: which draft tokens a verify call checks and how they hang together.

A row of a verify call is ``[last, d_0, d_1, ...]``: the row's last accepted token (not yet in the KV
cache) and its drafts. Each draft has a **parent**, the token it follows: ``-1`` for ``last``, else the
index of another draft (always an earlier one). A **chain** is the special case ``parents[i] = i - 1``; a
**tree** has drafts that share a parent (vLLM's ``SpecDecodeMetadata`` and SGLang's tree masks are the
model). A draft's **depth** is its distance from ``last`` (1 for a child of ``last``): its position in the
sequence is ``position + depth``, and siblings share one.

The drafts are ordered by priority: the top-1 chain first (``chain_len`` drafts, ``parents[i] = i - 1``),
then the other branches. Accepting along the chain then moves nothing: its drafts' KV is written at
their own positions. A draft ``i`` off the chain is written at slot ``position + 1 + i`` of the row's KV
and attends to the cache before ``position`` and its ancestors only (ONNX Runtime's graph derives that
from the positions, :mod:`qspec.backends.ort_attention`); when it is accepted, its KV moves to the slot
of its depth (:meth:`VerifyLayout.moves`).

Example: ``last`` at position 10, drafts ``[a, b, c]`` with parents ``[-1, 0, -1]`` (chain ``a b``, ``c``
the runner-up of ``a``): the call's positions are ``[10, 11, 12, 11]``. If the target's argmax after ``last``
is ``c``, the walk accepts ``c`` (draft 2), the bonus is the argmax after ``c``, and ``c``'s KV moves from
slot 13 to slot 11.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VerifyLayout:
    """One row's drafts and their tree: ``tokens`` ``[n]`` int64 and ``parents`` ``[n]`` (``-1``: the row's last
    accepted token; else an earlier draft's index), None for a chain (``parents[i] = i - 1``: every method then
    takes its few-microsecond path, the engine asks this of every row at every step)."""

    tokens: np.ndarray
    parents: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.parents is None:
            return
        n = len(self.tokens)
        assert len(self.parents) == n, f"{len(self.parents)} parents for {n} drafts"
        assert np.all((self.parents >= -1) & (self.parents < np.arange(n))), f"parents {self.parents} not earlier"

    @classmethod
    def chain(cls, tokens: np.ndarray) -> VerifyLayout:
        """Drafts that follow one another: ``parents = [-1, 0, 1, ...]``."""
        return cls(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def parent_ids(self) -> np.ndarray:
        """``[n]``: each draft's parent (``-1``: the row's last token)."""
        if self.parents is None:
            return np.arange(len(self.tokens), dtype=np.int64) - 1
        return self.parents

    @property
    def is_chain(self) -> bool:
        return self.chain_len == len(self.tokens)

    @property
    def chain_len(self) -> int:
        """The top-1 chain's drafts: the longest prefix with ``parents[i] = i - 1``."""
        if self.parents is None:
            return len(self.tokens)
        off = np.flatnonzero(self.parents != np.arange(len(self.parents)) - 1)
        return int(off[0]) if off.size else len(self.parents)

    @property
    def depths(self) -> np.ndarray:
        """``[n]``: each draft's distance from the row's last token (1 for its children)."""
        if self.parents is None:
            return np.arange(1, len(self.tokens) + 1, dtype=np.int64)
        depths = np.zeros(len(self.parents), np.int64)
        for i, parent in enumerate(self.parents.tolist()):
            depths[i] = 1 if parent < 0 else depths[parent] + 1
        return depths

    def positions(self, position: int) -> np.ndarray:
        """``[n + 1]``: the positions of ``[last, drafts...]`` for a row whose last token is at ``position``."""
        if self.parents is None:
            return np.arange(position, position + len(self.tokens) + 1, dtype=np.int64)
        return np.concatenate([[position], position + self.depths]).astype(np.int64)

    def cut(self, n: int) -> VerifyLayout:
        """The first ``n`` drafts (a draft's parent always comes before it: any prefix is a tree)."""
        if n >= len(self.tokens):
            return self
        return VerifyLayout(self.tokens[:n], None if self.parents is None else self.parents[:n])

    def walk_greedy(self, argmax: np.ndarray) -> tuple[list[int], int]:
        """``(path, bonus)``: the drafts the target accepts, walking from ``last``: at each accepted node the
        target's argmax (``argmax[0]`` after ``last``, ``argmax[1 + i]`` after draft ``i``) picks the child
        with that token; the walk ends at a node without one, whose argmax is the bonus.

        Chain ``[5, 6, 7]``, argmax ``[5, 6, 9, 4]``: ``([0, 1], 9)``. Tree ``[5, 6, 8]`` with parents
        ``[-1, 0, -1]``, argmax ``[8, 1, 2, 3]``: draft 2 (token 8) is accepted, ``([2], 3)``.
        """
        if self.parents is None:  # the longest prefix equal to the argmax
            n = len(self.tokens)
            mismatch = np.flatnonzero(argmax[:n] != self.tokens)
            accepted = int(mismatch[0]) if mismatch.size else n
            return list(range(accepted)), int(argmax[accepted])
        children: dict[int, dict[int, int]] = {}
        for i, (token, parent) in enumerate(zip(self.tokens.tolist(), self.parents.tolist())):
            children.setdefault(parent, {}).setdefault(token, i)  # the first child with a token wins
        path, node = [], -1
        while True:
            want = int(argmax[node + 1])
            child = children.get(node, {}).get(want)
            if child is None:
                return path, want
            path.append(child)
            node = child

    def moves(self, path: list[int], written: list[int] | None = None) -> list[tuple[int, int]]:
        """``(from, to)`` slot offsets past the row's last token of the accepted ``path``'s KV rows that are not at
        their depth: draft ``i`` was written at offset ``written[1 + i]`` (default ``1 + i``; a graph may place
        drafts off the chain further, :meth:`~qspec.runtime.session.LoadedModel.written_slots`) and belongs at
        ``depth(i)``. A chain moves nothing."""
        if self.parents is None:
            return []
        depths = self.depths
        slots = written or list(range(len(self.tokens) + 1))
        return [(slots[1 + i], int(depths[i])) for i in path if slots[1 + i] != depths[i]]

    def rows(self, path: list[int]) -> list[int]:
        """The call rows of ``[last, path...]`` in the row's ``[last, drafts...]``: the rows whose logits (and
        hidden states) precede each emitted token."""
        return [0, *(1 + i for i in path)]
