"""Serving metrics, named as users of serving engines know them.

- TTFT: arrival to first token; TPOT: ms per output token after the first;
- mean accepted tokens per target call: accepted drafts + 1 (the bonus), averaged over a sequence's
  decode calls; acceptance rate: accepted drafts / proposed drafts;
- calls per K: decode calls of each compiled specialization.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean, median
from typing import Any


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

    def first_token(self, now: float) -> None:
        self.first_token_time = now

    def target_call(self, k: int, *, proposed: int, accepted: int) -> None:
        self.target_calls += 1
        self.proposed += proposed
        self.accepted += accepted
        self.calls_per_k[k] = self.calls_per_k.get(k, 0) + 1

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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def aggregate(metrics: list[RequestMetrics], wall_s: float, calls: dict) -> EngineMetrics:
    """Totals and medians over ``metrics``; rates over the wall time of the whole run."""
    tokens = sum(m.output_tokens for m in metrics)
    proposed = sum(m.proposed for m in metrics)
    accepted = sum(m.accepted for m in metrics)
    seq_calls = sum(m.target_calls for m in metrics)
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
    )
