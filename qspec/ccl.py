"""Compute-context-length (CCL) buckets: the lists each prefill / decode shape is compiled for.

A CCL bucket bounds the KV slots a call attends to; the runtime picks the smallest bucket holding
every position of the call. Two rules turn the lists a user gives into the compiled buckets:

- ``qspec`` (the ort backend): the given values, sorted and distinct, plus ``ctx_len``.
- ``qefficient`` (the qaic backend): QEfficient's rules for ``qaic-compile``
  (``QEfficient/utils/check_ccl_specializations.py::validate_ccl_lists``): values below 1024 are
  raised to 1024, every value is capped at ``ctx_len``, ``ctx_len`` ends each list, and, "due to
  compiler limitations", prefill and decode values are distinct: a prefill value found in the decode
  list (or already taken) moves down to the next multiple of 32. With ``prefill_seq_len == 1``
  both lists are their union and nothing moves.

Worked example (``qefficient``): ``ctx_len=1024``, prefill ``[256]``, decode ``[256, 512]``: 256 and
512 are raised to 1024, so prefill ``[1024]`` and decode ``[1024]``; 1024 collides and the prefill
value moves to 992: prefill ``[992]``, decode ``[1024]``.

Automatic lists (QEfficient's ``ccl_enabled`` without lists, ``automatic_ccl_generation``): up to
``ctx_len`` 4096 one value; beyond, doubling from a start that grows with ``ctx_len`` (decode 4096 /
8192 / 16384, prefill 4000 / 8000 / 16000), at most 5 values a list, the last one ``ctx_len``.
QEfficient first raises ctx_len to a multiple of 1024; qspec asks for such a ctx_len instead.
"""

from __future__ import annotations

from typing import Literal

from qspec.common import FrozenModel
from qspec.errors import ConfigError

CclRule = Literal["qspec", "qefficient"]
CCL_MIN = 1024  # QEfficient's smallest bucket (CCL_MIN_CTX_LEN)
CCL_STEP = 32  # a colliding prefill value moves down to a multiple of this (CCL_UNIQNE_STEP)
AUTO_MAX_VALUES = 5  # automatic lists stop at this many values (CCL_MAX_ELEMENTS_LISTS)
AUTO_SINGLE_UP_TO = 4096  # up to this ctx_len the automatic lists hold ctx_len only (CCL_START_CTX_LEN)
# (largest ctx_len, decode start, prefill start) of the automatic lists (CCL_START_MAP)
AUTO_STARTS = ((32768, 4096, 4000), (65536, 8192, 8000), (None, 16384, 16000))
# QEfficient's automatic lists make at most 2 x 5 shapes (5 prefill + 5 decode, or 10 shared at
# prefill_seq_len 1); beyond that qspec warns, since no QEfficient compile was seen to pass it.
QEFFICIENT_MAX_CCL_SPECIALIZATIONS = 2 * AUTO_MAX_VALUES


class CclLists(FrozenModel):
    """The compiled buckets of each phase, ascending, and what a rule changed (one sentence each)."""

    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    changes: tuple[str, ...] = ()


def _doubling(start: int, limit: int, last: int | None = None, most: int = AUTO_MAX_VALUES) -> list[int]:
    """``start, 2*start, ...`` up to ``limit``, at most ``most`` values, the last one replaced by ``last`` if given."""
    values = []
    value = start
    while value <= limit and len(values) < most:
        values.append(value)
        value *= 2
    if last is not None and values[-1] != last:
        if len(values) < most:
            values.append(last)
        else:
            values[-1] = last
    return values


def automatic_lists(ctx_len: int, prefill_seq_len: int) -> tuple[list[int], list[int]]:
    """QEfficient's automatic (prefill, decode) lists for a ctx_len that is a multiple of 1024.

    ``ctx_len=32768`` -> prefill ``[4000, 8000, 16000, 32768]``, decode ``[4096, 8192, 16384, 32768]``
    (QEfficient's rule then moves the prefill 32768 to 32736).
    """
    if ctx_len % CCL_MIN:
        raise ConfigError(
            f"automatic compute-context-length lists need ctx_len a multiple of {CCL_MIN} (got {ctx_len}; "
            f"QEfficient would raise it to {-(-ctx_len // CCL_MIN) * CCL_MIN}): pass --ctx-len "
            f"{-(-ctx_len // CCL_MIN) * CCL_MIN} or give the lists"
        )
    if ctx_len <= AUTO_SINGLE_UP_TO:
        return [ctx_len], [ctx_len]
    if prefill_seq_len == 1:
        limit = min(ctx_len, AUTO_SINGLE_UP_TO * 2 ** (2 * AUTO_MAX_VALUES - 1))
        shared = _doubling(AUTO_SINGLE_UP_TO, limit, last=ctx_len, most=2 * AUTO_MAX_VALUES)
        return shared, list(shared)
    decode_start, prefill_start = next((d, p) for bound, d, p in AUTO_STARTS if bound is None or ctx_len <= bound)
    decode = _doubling(decode_start, ctx_len, last=ctx_len)
    power_of_two = ctx_len & (ctx_len - 1) == 0
    prefill = _doubling(prefill_start, ctx_len, last=None if power_of_two else ctx_len // 1000 * 1000)
    prefill[-1] = ctx_len  # the largest prompt must fit some prefill bucket
    return prefill, decode


def qspec_lists(prefill: tuple[int, ...] | None, decode: tuple[int, ...] | None, ctx_len: int) -> CclLists:
    """qspec's rule: the given values plus ctx_len, sorted and distinct; a list not given is ``[ctx_len]``."""
    return CclLists(
        prefill=tuple(sorted({*(prefill or ()), ctx_len})),
        decode=tuple(sorted({*(decode or ()), ctx_len})),
    )


def _raised(name: str, values: list[int], ctx_len: int, changes: list[str]) -> list[int]:
    """Values below :data:`CCL_MIN` raised to it, capped at ctx_len, ctx_len appended; sorted, distinct."""
    out = []
    for value in values:
        final = min(max(value, CCL_MIN), ctx_len)
        if final > value:
            changes.append(f"{name} {value} raised to {final} (QEfficient's smallest bucket is {CCL_MIN})")
        elif final < value:
            changes.append(f"{name} {value} capped at ctx_len {ctx_len}")
        out.append(final)
    return sorted({*out, ctx_len})


def qefficient_lists(
    prefill: tuple[int, ...] | None, decode: tuple[int, ...] | None, ctx_len: int, prefill_seq_len: int
) -> CclLists:
    """QEfficient's rule (module docstring); ``changes`` says each value it raised or moved."""
    changes: list[str] = []
    pre = _raised("comp_ctx_lengths_prefill", sorted(prefill or [ctx_len]), ctx_len, changes)
    dec = _raised("comp_ctx_lengths_decode", sorted(decode or [ctx_len]), ctx_len, changes)
    if prefill_seq_len == 1:  # prefill and decode shapes coincide: one shared list
        shared = tuple(sorted({*pre, *dec}))
        return CclLists(prefill=shared, decode=shared, changes=tuple(changes))
    moved: list[int] = []
    for value in pre:
        new = value
        while new in dec or new in moved:
            new = (new - 1) // CCL_STEP * CCL_STEP
        if new != value:
            changes.append(
                f"comp_ctx_lengths_prefill {value} moved to {new}: qaic-compile needs prefill and decode "
                "buckets distinct (QEfficient moves the prefill one down to a multiple of 32)"
            )
        moved.append(new)
    return CclLists(prefill=tuple(sorted(moved)), decode=tuple(dec), changes=tuple(changes))


def ccl_lists(
    rule: CclRule,
    prefill: tuple[int, ...] | None,
    decode: tuple[int, ...] | None,
    *,
    ctx_len: int,
    prefill_seq_len: int,
    auto: bool = False,
) -> CclLists:
    """The compiled buckets under ``rule``; ``auto`` with no list given starts from :func:`automatic_lists`."""
    if auto and not prefill and not decode:
        auto_prefill, auto_decode = automatic_lists(ctx_len, prefill_seq_len)
        prefill, decode = tuple(auto_prefill), tuple(auto_decode)
    if rule == "qefficient":
        return qefficient_lists(prefill, decode, ctx_len, prefill_seq_len)
    return qspec_lists(prefill, decode, ctx_len)
