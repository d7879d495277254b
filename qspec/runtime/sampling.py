"""Sampling and the acceptance rules of speculative decoding, as pure numpy functions.

Terms (shared with :mod:`qspec.runtime.proposers`): a step **proposes** ``n`` draft tokens; the
target model's verify call returns ``n + 1`` rows of logits, row ``i`` predicting the token at
draft position ``i``; the **accepted** drafts are a prefix of the proposed ones; the **bonus**
token is the one the target adds after them (at the first rejected position, or after all ``n``).
Each step thus emits ``num_accepted + 1`` tokens.

- Greedy (``temperature == 0``): :func:`accept_greedy`, exact argmax semantics.
- Sampled: :func:`accept_sampled`, lossless speculative sampling (Leviathan et al. 2023, Chen et
  al. 2023): the emitted tokens follow exactly the target's distribution whatever is drafted.
"""

from __future__ import annotations

import numpy as np
from pydantic import ConfigDict, Field, field_validator

from qspec.common import FrozenModel
from qspec.runtime.layout import VerifyLayout

# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


class SamplingParams(FrozenModel):
    """How one request picks its tokens and when it stops."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=0.0, ge=0)  # 0 = greedy
    top_k: int = Field(default=0, ge=0)  # 0 = off
    top_p: float = Field(default=1.0, gt=0, le=1)  # 1 = off
    seed: int | None = None
    max_new_tokens: int = Field(default=128, ge=1)
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0)  # None: off; n: each token's and the n most likely

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        """An empty stop string would match before every token: it is dropped, as the server does."""
        return [s for s in stop if s]

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax of the logits (``temperature == 0``)."""
        return self.temperature == 0


def make_rng(seed: int | None) -> np.random.Generator:
    """A request's random generator: PCG64 seeded with ``seed`` (None: fresh entropy)."""
    return np.random.Generator(np.random.PCG64(seed))


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float64; ``-inf`` entries get probability 0."""
    shifted = x - x.max(axis=-1, keepdims=True)  # max is finite: the top token is always kept
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def _top_k_mask(x: np.ndarray, top_k: int) -> np.ndarray:
    """``x`` with every value below the k-th largest of its row set to ``-inf`` (ties kept)."""
    if top_k <= 0 or top_k >= x.shape[-1]:
        return x
    kth = np.partition(x, -top_k, axis=-1)[:, -top_k, None]  # [n, 1]
    return np.where(x < kth, -np.inf, x)


def _top_p_mask(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Boolean mask [n, vocab] of tokens top-p keeps (HF's ``TopPLogitsWarper``).

    Sorted ascending, a token is dropped when the cumulative probability up to and including
    it is ``<= 1 - top_p``; the top token is always kept. This keeps the smallest set of top
    tokens whose probability reaches ``top_p``.
    """
    order = np.argsort(probs, axis=-1, kind="stable")  # [n, vocab] ascending
    cum = np.cumsum(np.take_along_axis(probs, order, axis=-1), axis=-1)
    drop_sorted = cum <= 1 - top_p
    drop_sorted[:, -1] = False
    keep = np.ones_like(probs, dtype=bool)
    np.put_along_axis(keep, order, ~drop_sorted, axis=-1)
    return keep


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token drawn from ``probs`` [vocab] (non-negative, not necessarily normalized).

    A token of probability 0 is never drawn, so a one-hot row always yields its token.
    """
    cdf = np.cumsum(probs, dtype=np.float64)
    assert cdf[-1] > 0, f"cannot sample from an all-zero distribution (sum {cdf[-1]})"
    u = rng.random() * cdf[-1]  # in [0, total): lands in the span of a token with p > 0
    token = int(np.searchsorted(cdf, u, side="right"))
    if token == cdf.shape[0]:  # u rounded up to the total: the last token with p > 0
        token = int(np.flatnonzero(probs)[-1])
    return token


# --------------------------------------------------------------------------------------------
# Core
# --------------------------------------------------------------------------------------------


def sample_tokens(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> list[int]:
    """One token per row of ``logits`` [n, vocab]: the argmax when greedy, else drawn from the processed probs."""
    if params.greedy:
        return [int(t) for t in logits.argmax(axis=-1)]
    return [sample_token(p, rng) for p in process_logits(logits, params)]


def process_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Target probabilities [n, vocab] float64 from logits [n, vocab]: temperature, top-k, top-p.

    ``temperature == 0`` gives the one-hot of the argmax (ties -> lowest index), so sampling
    from it, or :func:`accept_sampled` on it, is exactly greedy decoding.
    """
    x = np.asarray(logits, dtype=np.float64)
    assert x.ndim == 2, f"logits must be [n, vocab], got shape {x.shape}"
    if params.greedy:
        probs = np.zeros_like(x)
        probs[np.arange(x.shape[0]), x.argmax(axis=-1)] = 1.0
        return probs
    x = _top_k_mask(x / params.temperature, params.top_k)
    probs = _softmax(x)
    if params.top_p < 1.0:
        probs = np.where(_top_p_mask(probs, params.top_p), probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def accept_greedy(target_argmax: np.ndarray, drafts: np.ndarray) -> tuple[int, int]:
    """Greedy acceptance: ``(num_accepted, bonus_token)``.

    ``target_argmax`` [n + 1] is the argmax of each verify row, ``drafts`` [n] the proposed
    tokens. The accepted drafts are the longest prefix of ``drafts`` equal to the argmax; the
    bonus is the argmax at the first mismatch, or of the last row when all ``n`` are accepted.

    Example: ``drafts = [5, 6, 7]``, ``target_argmax = [5, 6, 9, 4]``: drafts 5 and 6 are
    accepted, 7 is rejected and the target says 9: ``(2, 9)``; the step emits ``[5, 6, 9]``.
    With ``target_argmax = [5, 6, 7, 4]``: ``(3, 4)``, emitting ``[5, 6, 7, 4]``.
    """
    drafts = np.asarray(drafts, dtype=np.int64)
    n = drafts.shape[0]
    assert target_argmax.shape[0] >= n + 1, (
        f"need n + 1 = {n + 1} verify rows for {n} drafts, got {target_argmax.shape[0]}"
    )
    path, bonus = VerifyLayout.chain(drafts).walk_greedy(target_argmax)  # a chain's walk: its accepted prefix
    return len(path), bonus


def accept_sampled(
    probs: np.ndarray,
    drafts: np.ndarray,
    rng: np.random.Generator,
    draft_probs: np.ndarray | None = None,
) -> tuple[int, int]:
    """Lossless speculative sampling: ``(num_accepted, next_token)``.

    ``probs`` [n + 1, vocab] are the target's distributions (:func:`process_logits`) at each
    draft position and after the last; ``drafts`` [n] the proposed tokens. Draft ``x`` at row
    ``i`` with target distribution ``p``:

    - deterministic proposer (``draft_probs`` None: prompt lookup, suffix, user drafts): accept
      with probability ``p(x)``; on rejection draw from ``p`` with ``x`` removed, renormalized.
      Then ``P(emit y) = p(x)[y = x] + (1 - p(x)) p(y) / (1 - p(x))[y != x] = p(y)``.
    - draft model (``draft_probs`` [n, vocab], row ``i`` = ``q`` that ``x`` was drawn from):
      accept with probability ``min(1, p(x) / q(x))``; on rejection draw from ``max(0, p - q)``,
      renormalized.

    The first rejection ends the step with the redrawn token as ``next_token``; if all ``n``
    drafts are accepted, ``next_token`` (the bonus) is drawn from ``probs[n]``. With one-hot
    ``probs`` (temperature 0) this is exactly :func:`accept_greedy`.
    """
    drafts = np.asarray(drafts)
    n = drafts.shape[0]
    assert probs.shape[0] >= n + 1, f"need n + 1 = {n + 1} rows of probs for {n} drafts, got {probs.shape[0]}"
    for i, x in enumerate(drafts.tolist()):
        p = probs[i]
        if draft_probs is None:
            if rng.random() < p[x]:
                continue
            residual = p.copy()
            residual[x] = 0.0
        else:
            q = draft_probs[i]
            if rng.random() * q[x] < p[x]:
                continue
            residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0:  # the target puts all its mass where the draft did: accept
            continue
        return i, sample_token(residual, rng)
    return n, sample_token(probs[n], rng)
