"""The per-request state of the hidden-state proposers (:mod:`qspec.runtime.heads`): a request's tokens and the
target's hidden states, and one step's drafting row."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qspec.runtime.proposal import Proposal


def softmax_top(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(argmax, its probability)`` of each row of ``logits`` ``[rows, vocab]``."""
    top = logits.argmax(axis=-1)
    x = logits.astype(np.float64)
    peak = x.max(axis=-1, keepdims=True)
    return top, 1.0 / np.exp(x - peak).sum(axis=-1)


@dataclass
class HeadRequest:
    """What a head proposer keeps of a request between steps."""

    row: int  # the head's KV row
    tokens: list[int]  # prompt and every emitted token: x_0 .. x_N
    hidden: np.ndarray  # [ctx_len, hidden]: f_t for t < known
    known: int = 0  # hidden states known for positions < known
    cached: int = 0  # pairs t < cached are in the head's KV cache
    greedy: bool = True  # how the request samples (dispatch covers a sampled row's drafts)


@dataclass
class HeadRow:
    """One request's drafting in a step: its chain so far (and a tree's sibling of the first draft)."""

    request: HeadRequest
    cap: int
    drafts: list[int] = field(default_factory=list)
    feature: np.ndarray | None = None  # the head's predicted feature after the last draft
    going: bool = True
    confidence: float = 1.0  # product of the drafts' probabilities: how likely the whole chain is right
    first: float = 0.0  # the first draft's probability (Proposal.confidence)
    survival: list[float] = field(default_factory=list)  # the chain's probability after each draft (Proposal.survival)
    sibling: tuple[int, float] | None = None  # the head's runner-up for the first draft and its probability (a tree)

    def proposal(self, *, tree: bool = False) -> Proposal:
        """The chain's drafts; ``tree``: with the runner-up of the first draft beside it (parent ``-1``)."""
        if not (tree and self.sibling is not None and self.drafts):
            drafts = np.asarray(self.drafts, np.int64)
            return Proposal(drafts, confidence=self.first, survival=np.asarray(self.survival))
        token, prob = self.sibling
        n = len(self.drafts)
        return Proposal(
            np.asarray([*self.drafts, token], np.int64),
            confidence=self.first,
            survival=np.asarray([*self.survival, prob]),
            parents=np.concatenate([np.arange(n, dtype=np.int64) - 1, [-1]]),
        )
