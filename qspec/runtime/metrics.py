"""Serving metrics, named as users of serving engines know them.

- TTFT: arrival to first token; TPOT: ms per output token after the first;
- mean accepted tokens per target call: accepted drafts + 1 (the bonus), averaged over a sequence's
  decode calls; acceptance rate: accepted drafts / proposed drafts;
- acceptance per draft position: position i's rate is the share of the calls that reached draft i
  (proposed at least i drafts and had the first i - 1 accepted) whose draft i was accepted. Two calls,
  3 drafts with 1 accepted and 2 drafts with 2 accepted: reached ``[2, 2, 0]``, accepted ``[2, 1, 0]``,
  rates ``[1.0, 0.5, None]`` (:func:`acceptance_per_position`);
- calls per K: decode calls of each compiled specialization;
- seconds: where the wall time went: ``prefill`` (the prompts' calls, each first token included), ``decode``
  (inside the target's decode calls) and ``propose`` (the proposer's drafting, a head's calls included); the
  rest is the host's (the engine's Python: dispatch, acceptance, detokenizing), :func:`step_times`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean, median
from typing import Any, NamedTuple


def count_positions(reached: list[int], accepted_at: list[int], *, proposed: int, accepted: int) -> None:
    """Add one call that proposed ``proposed`` drafts and had ``accepted`` of them accepted to the per-position
    counts (in place, grown to ``proposed`` positions): it reached drafts ``1 .. min(accepted + 1, proposed)``
    and accepted drafts ``1 .. accepted``."""
    assert 0 <= accepted <= proposed, f"accepted {accepted} of {proposed} proposed drafts"
    for counts in (reached, accepted_at):
        counts.extend([0] * (proposed - len(counts)))
    for i in range(min(accepted + 1, proposed)):
        reached[i] += 1
    for i in range(accepted):
        accepted_at[i] += 1


def sum_positions(lists: list[list[int]]) -> list[int]:
    """Element-wise sum of per-position counts of different lengths: ``[[2, 1], [1]] -> [3, 1]``."""
    total = [0] * max((len(counts) for counts in lists), default=0)
    for counts in lists:
        for i, value in enumerate(counts):
            total[i] += value
    return total


def acceptance_per_position(reached: list[int], accepted_at: list[int]) -> list[float | None]:
    """Position i's acceptance rate: accepted / reached (None where no call reached it)."""
    return [round(a / r, 4) if r else None for r, a in zip(reached, accepted_at)]


@dataclass
class RequestMetrics:
    """One request's timings and speculation counts (times from ``time.perf_counter``)."""

    arrival: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    output_tokens: int = 0
    target_calls: int = 0
    proposed: int = 0
    accepted: int = 0
    calls_per_k: dict[int, int] = field(default_factory=dict)
    # index i - 1: calls that reached draft i (proposed >= i, the first i - 1 accepted); calls that accepted it
    reached_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def first_token(self, now: float) -> None:
        self.first_token_time = now

    def target_call(self, k: int, *, proposed: int, accepted: int) -> None:
        self.target_calls += 1
        self.proposed += proposed
        self.accepted += accepted
        self.calls_per_k[k] = self.calls_per_k.get(k, 0) + 1
        count_positions(self.reached_per_position, self.accepted_per_position, proposed=proposed, accepted=accepted)

    def finish(self, now: float, output_tokens: int) -> None:
        self.finish_time = now
        self.output_tokens = output_tokens

    @property
    def ttft_s(self) -> float:
        return self.first_token_time - self.arrival

    @property
    def e2e_s(self) -> float:
        return self.finish_time - self.arrival

    @property
    def tpot_s(self) -> float:
        after_first = self.output_tokens - 1
        return (self.finish_time - self.first_token_time) / after_first if after_first > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        return (self.accepted + self.target_calls) / self.target_calls if self.target_calls else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_ms": round(self.ttft_s * 1000, 2),
            "tpot_ms": round(self.tpot_s * 1000, 2),
            "e2e_s": round(self.e2e_s, 4),
            "output_tokens": self.output_tokens,
            "tokens_per_s": round(self.output_tokens / self.e2e_s, 2) if self.e2e_s > 0 else 0.0,
            "target_calls": self.target_calls,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "calls_per_k": {str(k): v for k, v in sorted(self.calls_per_k.items())},
            "reached_per_position": list(self.reached_per_position),
            "accepted_per_position": list(self.accepted_per_position),
        }


@dataclass
class EngineMetrics:
    """One ``generate`` call over many requests."""

    requests: int
    wall_s: float
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms_median: float
    ttft_ms_mean: float
    tpot_ms_median: float
    tpot_ms_mean: float
    mean_accepted_tokens: float
    acceptance_rate: float
    proposed: int
    accepted: int
    sequence_calls: int  # (sequence, decode call) pairs
    calls: dict[str, int]  # engine calls: "prefill" and one entry per K
    # Per draft position (see the module doc); empty when nothing was proposed.
    reached_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_per_position: list[float | None] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # "prefill", "decode", "propose" (module doc)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class StepTimes(NamedTuple):
    """A decode step's ms: the whole (wall time outside prefill calls), inside the target's call, drafting, and the
    host's rest with its share of the whole."""

    steps: int
    step_ms: float
    target_ms: float
    drafting_ms: float
    host_ms: float
    host_share: float


def step_times(wall_s: float, calls: dict, seconds: dict) -> StepTimes | None:
    """Where a decode step's time went (``seconds`` over the decode calls of ``calls``); None without decode calls
    or timings. 10 s of wall, 1 s prefill, 8 s decode calls, 0.5 s proposing, 1,000 decode calls: a 9 ms step,
    8 in the target's call, 0.5 drafting, 0.5 the host's, 0.5 / 9 = 5.6 % of a step."""
    steps = sum(n for k, n in calls.items() if str(k) != "prefill")
    if not steps or not seconds:
        return None
    ms = {part: seconds.get(part, 0.0) * 1000 / steps for part in ("prefill", "decode", "propose")}
    step = wall_s * 1000 / steps - ms["prefill"]
    host = step - ms["decode"] - ms["propose"]
    return StepTimes(steps, step, ms["decode"], ms["propose"], host, host / step if step > 0 else 0.0)


def aggregate(metrics: list[RequestMetrics], wall_s: float, calls: dict, seconds: dict | None = None) -> EngineMetrics:
    """Totals and medians over ``metrics``; rates over the wall time of the whole run; ``seconds``: where it went
    (the engine's timings, see the module doc)."""
    tokens = sum(m.output_tokens for m in metrics)
    proposed = sum(m.proposed for m in metrics)
    accepted = sum(m.accepted for m in metrics)
    seq_calls = sum(m.target_calls for m in metrics)
    reached = sum_positions([m.reached_per_position for m in metrics])
    accepted_at = sum_positions([m.accepted_per_position for m in metrics])
    ttft = [m.ttft_s * 1000 for m in metrics] or [0.0]
    tpot = [m.tpot_s * 1000 for m in metrics if m.output_tokens > 1] or [0.0]
    return EngineMetrics(
        requests=len(metrics),
        wall_s=round(wall_s, 4),
        output_tokens=tokens,
        requests_per_s=round(len(metrics) / wall_s, 4) if wall_s > 0 else 0.0,
        output_tokens_per_s=round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        ttft_ms_median=round(median(ttft), 2),
        ttft_ms_mean=round(mean(ttft), 2),
        tpot_ms_median=round(median(tpot), 2),
        tpot_ms_mean=round(mean(tpot), 2),
        mean_accepted_tokens=round((accepted + seq_calls) / seq_calls, 4) if seq_calls else 0.0,
        acceptance_rate=round(accepted / proposed, 4) if proposed else 0.0,
        proposed=proposed,
        accepted=accepted,
        sequence_calls=seq_calls,
        calls={str(k): v for k, v in calls.items()},
        reached_per_position=reached,
        accepted_per_position=accepted_at,
        acceptance_per_position=acceptance_per_position(reached, accepted_at),
        seconds={part: round(value, 4) for part, value in (seconds or {}).items()},
    )
