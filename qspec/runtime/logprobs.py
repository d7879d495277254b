"""Log-probabilities of emitted tokens, as OpenAI's ``logprobs`` report them: the target model's own
distribution (raw logits, before temperature, top-k or top-p), whatever proposed the token.

A speculative step emits ``accepted + 1`` tokens from one verify call whose logits row ``i`` is the
target's prediction at that token's position, so a token's log-probability is the one a plain
(``K = 0``) run computes at the same position: speculation does not change what a client reads.

>>> logits = np.log(np.array([[0.5, 0.25, 0.25]]))
>>> [entry] = token_logprobs(logits, [1], top=1)
>>> entry.token, round(entry.logprob, 3), [(t, round(lp, 3)) for t, lp in entry.top]
(1, -1.386, [(0, -0.693)])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token, its log-probability and the ``top`` most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob), most likely first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log softmax`` over the last axis, in float64."""
    x = logits.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, tokens: list[int], *, top: int) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability under ``logits[i]`` [n >= len(tokens), vocab], with the ``top`` best
    alternatives of each row (ties broken by the lower token id, as a stable sort does)."""
    logp = log_softmax(logits[: len(tokens)])  # [len(tokens), vocab]
    entries = []
    for row, token in zip(logp, tokens):
        best = np.argsort(-row, kind="stable")[:top] if top > 0 else []
        entries.append(TokenLogprob(int(token), float(row[token]), [(int(t), float(row[t])) for t in best]))
    return entries
