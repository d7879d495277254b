"""The proposer contract: what the engine may ask of any proposer, and the record a proposal travels in.

A request's life in a proposer::

    start(id, prompt, params, rng)      the prompt, and how the request samples
    [propose_batch([(id, cap), ...])    a Proposal per request: at most ``cap`` drafts (+ their q)
     extend(id, accepted + bonus)]*     the tokens the step emitted
    finish(id)

Everything a step hands from the proposer to the verifier is in the :class:`Proposal` (the drafts
and, for a draft model that samples, the distributions they were drawn from): nothing is kept in
the proposer between ``propose`` and ``extend``. Terms (proposed, accepted, bonus) as in
:mod:`qspec.runtime.proposers`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from qspec.runtime.layout import VerifyLayout
from qspec.runtime.sampling import SamplingParams

RequestId = Hashable
CONFIDENCE_CLASSES = 10  # Proposal.dispatch_class: a draft's confidence in tenths
# (proposal so far, cap, greedy, ms a further draft costs) -> how many drafts the engine's dispatch would verify
DepthLimit = Callable[["Proposal", int, bool, float], int]
Tokens = np.ndarray | Sequence[int]


def unknown_request(request_id: RequestId) -> KeyError:
    """The error of a proposer asked about a request it was never told of (every proposer raises this one)."""
    return KeyError(f"unknown request {request_id!r}: call start() before extend/propose/finish")


def as_tokens(tokens: Tokens) -> np.ndarray:
    """``tokens`` as a 1-D int64 array (a copy only when needed)."""
    arr = np.asarray(tokens, dtype=np.int64)
    assert arr.ndim == 1, f"tokens must be 1-D, got shape {arr.shape}"
    return arr


@dataclass(frozen=True)
class Proposal:
    """One request's drafts for one step.

    ``probs`` [n, vocab]: row ``i`` is the distribution ``q`` draft ``i`` was drawn from (a draft
    model that samples); None when each draft is a point mass (prompt lookup, suffix, user drafts,
    greedy draft models). The verifier's ``min(1, p / q)`` rule needs it.

    ``match_len``: how long a match of the history the drafts continue (prompt lookup: the n-gram's
    length; suffix decoding: the matched suffix's); 0 when the proposer has no such measure.
    ``confidence``: the proposer's own probability that its first draft is right (a draft head's
    softmax), None when it has none. ``survival`` ``[n]``: the proposer's probability that drafts
    ``1..i`` are all right (a head: the product of its softmax tops along the chain), None when it has
    none. Cost dispatch prices a proposal with a survival by it, calibrated by what the target accepted
    (:class:`~qspec.runtime.acceptance.SurvivalStats`), and one without by the statistics of its
    :attr:`dispatch_class` (per match length, or per tenth of confidence).

    ``parents`` ``[n]``: the drafts form a tree (:class:`~qspec.runtime.layout.VerifyLayout`: the top-1 chain
    first, then drafts off it, each naming its parent; ``-1`` the row's last token); None: a chain. A draft
    off the chain has as ``survival`` its own probability given its parent was right (a head's runner-up).
    """

    tokens: np.ndarray  # [n] int64
    probs: np.ndarray | None = None  # [n, vocab]
    match_len: int = 0
    confidence: float | None = None
    survival: np.ndarray | None = None  # [n] float64, falling along the chain
    parents: np.ndarray | None = None  # [n] int64: a tree's (VerifyLayout); None: a chain

    def __post_init__(self) -> None:
        if self.probs is not None:
            assert self.probs.shape[0] == len(self.tokens), (
                f"{self.probs.shape[0]} q rows for {len(self.tokens)} drafts"
            )
        if self.survival is not None:
            assert len(self.survival) == len(self.tokens), f"{len(self.survival)} survivals, {len(self.tokens)} drafts"

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def layout(self) -> VerifyLayout:
        """How the drafts verify: a chain, or the tree of ``parents`` (:class:`~qspec.runtime.layout.VerifyLayout`)."""
        return VerifyLayout(self.tokens, self.parents)

    def cut(self, n: int) -> Proposal:
        """The first ``n`` drafts (and their q): the chain's first, then the other branches (a tree's order)."""
        if n >= len(self.tokens):
            return self
        return Proposal(
            self.tokens[:n],
            None if self.probs is None else self.probs[:n],
            self.match_len,
            self.confidence,
            None if self.survival is None else self.survival[:n],
            None if self.parents is None or self.layout.cut(n).is_chain else self.parents[:n],
        )

    def chain_only(self) -> Proposal:
        """The top-1 chain of a tree (a row that samples, or a backend without tree verification, checks it)."""
        return self if self.parents is None else self.cut(self.layout.chain_len)

    @property
    def dispatch_class(self) -> int:
        """The acceptance statistics this proposal shares: ``match_len``, or ``-1 - tenths`` of its confidence."""
        if self.confidence is None:
            return self.match_len
        return confidence_class(self.confidence)

    @classmethod
    def empty(cls) -> Proposal:
        return cls(np.zeros(0, dtype=np.int64))


def confidence_class(confidence: float) -> int:
    """:attr:`Proposal.dispatch_class` of a proposal whose first draft has probability ``confidence``."""
    return -1 - min(int(confidence * CONFIDENCE_CLASSES), CONFIDENCE_CLASSES - 1)


class Proposer(ABC):
    """Offers drafts for each request; told what each step emitted. The engine calls only these.

    A proposer implements ``start``, ``extend``, ``propose`` and ``finish``; one that drafts a
    whole batch at once (a draft model) overrides ``propose_batch``; one with requirements on the
    target (a draft model: vocabulary, context, KV slots) overrides ``check_target``. One that reads
    the target's hidden states (EAGLE, Medusa heads) sets ``wants_hidden_states`` and implements
    ``observe_hidden``: the engine then hands it every computed position's hidden state before the
    ``extend`` of the tokens that follow them.
    """

    wants_hidden_states: bool = False

    @abstractmethod
    def start(
        self,
        request_id: RequestId,
        prompt_tokens: Tokens,
        params: SamplingParams | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        """Begin ``request_id`` with its prompt; ``params``/``rng``: how it samples (a draft model samples alike)."""

    @abstractmethod
    def extend(self, request_id: RequestId, new_tokens: Tokens) -> None:
        """Append the tokens one step emitted (accepted drafts and the bonus token)."""

    @abstractmethod
    def propose(self, request_id: RequestId, k: int) -> np.ndarray:
        """At most ``k`` drafts (int64, possibly empty) to follow the request's history."""

    @abstractmethod
    def finish(self, request_id: RequestId) -> None:
        """Forget ``request_id`` (a proposer may keep what it learned from it)."""

    def observe_hidden(self, request_id: RequestId, start: int, hidden: np.ndarray) -> None:
        """The target's final-norm hidden states ``[n, hidden]`` at positions ``start .. start + n - 1`` of the
        request (prompt chunks, then each step's verified rows up to the bonus). Only when ``wants_hidden_states``."""
        raise NotImplementedError(f"{type(self).__name__} does not read hidden states")

    def proposal(self, request_id: RequestId, k: int) -> Proposal:
        """:meth:`propose`'s drafts as a :class:`Proposal`; a proposer that measures its match overrides
        this to say how long it is (:attr:`Proposal.match_len`)."""
        return Proposal(as_tokens(self.propose(request_id, k)))

    def propose_batch(self, items: Sequence[tuple[RequestId, int]]) -> list[Proposal]:
        """A proposal of at most ``cap`` drafts for each ``(request_id, cap)``; by default one by one."""
        return [self.proposal(rid, cap) if cap > 0 else Proposal.empty() for rid, cap in items]

    def check_target(self, *, vocab_size: int, ctx_len: int, num_slots: int) -> None:
        """Raise ConfigError when this proposer cannot serve the target; most proposers serve any."""

    def limit_depth(self, useful: DepthLimit | None) -> None:
        """The engine says how deep its dispatch would verify a proposal: ``useful(drafts so far, cap, greedy,
        draft_ms)`` (:meth:`~qspec.runtime.dispatch.Dispatcher.useful_depth`). A proposer that pays a call for
        every further draft (a head's chain) asks after each draft and stops when the answer is not more than it
        has; lookup drafts cost nothing to make, so by default this is ignored."""
