"""How closely one package follows another (e.g. int4 against fp32): next-token agreement, greedy equality.

Two measures, both on the same prompts:

- **top-1 agreement** (teacher-forced): both packages read the same text, the prompt followed by the
  reference's greedy continuation, and predict the next token at every position; the share of
  positions where their argmax agrees. It does not compound: one early difference does not make
  every later position disagree.
- **greedy equality**: for how many prompts the candidate's greedy output equals the reference's,
  and where the first differing token is when it does not.

>>> report = compare_packages("packages/m-k0_4", "packages/m-int4-k0_4", prompts, max_new_tokens=64)
>>> report.top1_agreement, report.greedy_equal, report.prompts
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from pydantic import Field

from qspec.common import FrozenModel
from qspec.runtime.engine import Engine
from qspec.runtime.sampling import SamplingParams
from qspec.runtime.session import LoadedModel


class QualityReport(FrozenModel):
    """A candidate package against a reference package on the same prompts."""

    reference: str
    candidate: str
    prompts: int
    positions: int  # next-token predictions compared, over all prompts
    top1_agreement: float = Field(ge=0, le=1)
    greedy_equal: int  # prompts whose greedy outputs are token-for-token equal
    first_divergence: list[int | None]  # per prompt: index of the first differing output token


def teacher_forced_argmax(model: LoadedModel, tokens: Sequence[int]) -> np.ndarray:
    """Argmax of the next token after every prefix of ``tokens``: ``out[i]`` predicts ``tokens[i + 1]``.

    Feeds ``tokens`` through row 0 of the largest decode specialization, K + 1 tokens per call at
    consecutive positions (the last chunk right-padded); a speculative graph returns the logits of
    every token of such a call. Example, K = 4, 7 tokens: calls ``[t0..t4]`` and ``[t5, t6, pad, pad,
    pad]``, whose last 2 logits belong to ``t5, t6``.
    """
    bound = model.decode[model.ks[-1]]
    width = bound.spec.seq_len
    if len(tokens) > model.ctx_len:
        raise ValueError(f"{len(tokens)} tokens do not fit the package's ctx_len {model.ctx_len}")
    out = []
    for start in range(0, len(tokens), width):
        chunk = list(tokens[start : start + width])
        bound.reset()
        bound.input_ids[0, : len(chunk)] = chunk
        bound.position_ids[0, : len(chunk)] = np.arange(start, start + len(chunk))
        if bound.batch_index is not None:
            bound.batch_index[:, 0] = np.arange(bound.batch_index.shape[0])
        logits = model.run(bound)  # [batch, keep, vocab]; the real tokens' logits are the last ones
        out.append(logits[0, -len(chunk) :].argmax(axis=-1))
    return np.concatenate(out)


def compare_packages(
    reference: str | Path,
    candidate: str | Path,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    chat: bool = True,
) -> QualityReport:
    """Greedy outputs of both packages on ``prompts``, then top-1 agreement on prompt + reference output."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    engines = [Engine(package, method="none") for package in (reference, candidate)]
    ref_out, cand_out = (engine.generate(list(prompts), params, chat=chat) for engine in engines)
    agree = total = 0
    divergence: list[int | None] = []
    for ref, cand in zip(ref_out, cand_out):
        divergence.append(_first_difference(ref.token_ids, cand.token_ids))
        text = (ref.prompt_token_ids + ref.token_ids)[: engines[0].model.ctx_len]
        ref_pred, cand_pred = (teacher_forced_argmax(engine.model, text) for engine in engines)
        agree += int((ref_pred[:-1] == cand_pred[:-1]).sum())  # the last prediction has no text to check
        total += len(text) - 1
    return QualityReport(
        reference=str(reference),
        candidate=str(candidate),
        prompts=len(prompts),
        positions=total,
        top1_agreement=round(agree / max(total, 1), 4),
        greedy_equal=sum(d is None for d in divergence),
        first_divergence=divergence,
    )


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
