"""From what the rounds produced to the report's numbers: summaries, ratios, equality checks, contention.

Rates: a configuration's requests/s and tokens/s are over the summed wall time of its rounds. Per
category, requests/s is ``requests / Σ request latency``: the throughput at batch 1, a per-stream
rate at batch B. "Ratio" is always against qspec ``none`` of the same weight format at the same batch
size (a baseline's: against the primary format's ``none``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from qspec.bench.machine import CONTENTION_NOTE
from qspec.bench.plan import QSPEC, RunConfig
from qspec.bench.report import (
    CategoryRow,
    ConfigSummary,
    Equality,
    EqualityCheck,
    Mismatch,
    OutputComparison,
    Overall,
)
from qspec.bench.runners import RequestResult
from qspec.runtime.metrics import aggregate


@dataclass(frozen=True)
class CategoryInput:
    """What the per-category table needs of one request."""

    category: str
    output_tokens: int
    e2e_s: float


@dataclass
class Collected:
    """Everything one configuration produced over the rounds."""

    config: RunConfig
    requests: dict[str, tuple[str, RequestResult]] = field(default_factory=dict)  # id -> (category, result)
    walls: list[float] = field(default_factory=list)
    other_cpu: list[float] = field(default_factory=list)  # other processes' CPU share during each round
    calls: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)  # where the engine's wall time went (EngineMetrics.seconds)

    def tokens(self) -> dict[str, list[int]]:
        return {rid: result.tokens for rid, (_, result) in self.requests.items()}


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference`` rounded to 3 places; None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return round(value / reference, 3)


def category_rates(requests: Sequence[CategoryInput]) -> dict[str, CategoryRow]:
    """Per category: requests, output tokens, Σ latency, and the rates over that latency.

    Two requests of 2 s and 4 s with 10 and 30 tokens give ``requests_per_s = 2 / 6``,
    ``output_tokens_per_s = 40 / 6``.
    """
    groups: dict[str, list[CategoryInput]] = defaultdict(list)
    for request in requests:
        groups[request.category].append(request)
    table = {}
    for category in sorted(groups):
        items = groups[category]
        latency = sum(r.e2e_s for r in items)
        tokens = sum(r.output_tokens for r in items)
        table[category] = CategoryRow(
            requests=len(items),
            output_tokens=tokens,
            latency_s=round(latency, 4),
            requests_per_s=round(len(items) / latency, 4) if latency > 0 else 0.0,
            output_tokens_per_s=round(tokens / latency, 2) if latency > 0 else 0.0,
        )
    return table


def _natural_key(rid: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in rid.replace("/", " ").split())


def compare_outputs(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> OutputComparison:
    """Requests whose tokens equal the reference's, and where the first mismatches diverge.

    ``{"a": [1, 2, 3]}`` against ``{"a": [1, 2, 4]}`` -> 0 of 1 equal, ``a`` diverges at token 2, and
    the common prefix is 2 / 3 of the longer output (``mean_common_prefix`` averages that over requests,
    1.0 for an equal one): how far another runtime follows qspec before a near-tie flips.
    """
    common = sorted(set(outputs) & set(reference), key=_natural_key)
    mismatches = []
    fractions = []
    for rid in common:
        mine, theirs = outputs[rid], reference[rid]
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        fractions.append(at / max(len(mine), len(theirs)) if mine != theirs else 1.0)
        if mine != theirs:
            mismatches.append(Mismatch(request=rid, first_difference_at=at, lengths=[len(mine), len(theirs)]))
    prefix = round(sum(fractions) / len(fractions), 4) if fractions else 1.0
    return OutputComparison(
        equal=len(common) - len(mismatches), total=len(common), mismatches=mismatches, mean_common_prefix=prefix
    )


def summarize(collected: Collected, *, peak_rss_mb: float | None = None) -> ConfigSummary:
    """Overall metrics (``EngineMetrics`` fields, calls per K) and the per-category table."""
    config = collected.config
    metrics = [result.metrics for _, result in collected.requests.values()]
    engine = aggregate(metrics, sum(collected.walls), dict(collected.calls), dict(collected.seconds))
    # transformers does not say how many tokens it proposed (a peer does): no acceptance rate then.
    proposed = any(result.metrics.proposed for _, result in collected.requests.values())
    overall = Overall.from_metrics(engine, proposals_known=not config.baseline or proposed)
    rows = [CategoryInput(c, r.metrics.output_tokens, r.metrics.e2e_s) for c, r in collected.requests.values()]
    return ConfigSummary.for_config(
        config,
        overall=overall.model_copy(update={"peak_rss_mb": peak_rss_mb}),
        per_category=category_rates(rows),
        round_walls_s=[round(w, 3) for w in collected.walls],
        round_other_cpu=collected.other_cpu,
    )


def with_ratios(summaries: list[ConfigSummary]) -> list[ConfigSummary]:
    """The summaries with ``ratio_to_none``: requests/s overall and per category against ``none``.

    A qspec configuration's ``none`` is of its weight format at its batch size; a baseline's, the
    primary format's (the first qspec summary's) at its batch size.
    """
    nones = {(s.weight_format, s.batch): s for s in summaries if s.method == "none" and s.backend == QSPEC}
    primary = next((s.weight_format for s in summaries if s.backend == QSPEC), None)
    out = []
    for s in summaries:
        none = nones.get((s.weight_format if s.backend == QSPEC else primary, s.batch))
        if none is None:
            out.append(s)
            continue
        overall = s.overall.model_copy(
            update={"ratio_to_none": ratio(s.overall.requests_per_s, none.overall.requests_per_s)}
        )
        rows = {}
        for category, row in s.per_category.items():
            reference = none.per_category.get(category)
            value = ratio(row.requests_per_s, reference.requests_per_s if reference else None)
            rows[category] = row.model_copy(update={"ratio_to_none": value})
        out.append(s.model_copy(update={"overall": overall, "per_category": rows}))
    return out


def _reference(config: RunConfig, nones: dict[tuple[str, int], str], first_none: str) -> tuple[str, str] | None:
    """(reference key, kind) of a configuration's equality check; None for the run's first ``none``."""
    if config.baseline:  # qspec none of its weights when qspec ran them (ORT GenAI int4: none-int4), else the first
        return nones.get((config.weight_format, config.batch), first_none), "baseline"
    if config.method != "none":
        return nones[config.weight_format, config.batch], "speculative"
    own = nones[config.weight_format, min(b for f, b in nones if f == config.weight_format)]
    if own != config.key:
        return own, "batch"  # none@B against none@1 of its format
    return (first_none, "format") if own != first_none else None


def equality_checks(collected: dict[str, Collected]) -> Equality:
    """Greedy tokens of every configuration against ``none`` of its weight format at its batch size.

    ``speculative_equal_none`` is the headline: every speculative configuration reproduced ``none``
    of the same package token for token (greedy equality holds per package; quantized weights change
    the logits, so it does not hold across formats). Also reported, as information, not a gate:
    ``none`` at batch B against batch 1, each other format's ``none`` against the first one's (fp32),
    and the baselines against qspec's ``none`` of their weight format (the first ``none`` when qspec
    did not run that format): float sums in another order may flip a near-tie.
    """
    tokens = {key: c.tokens() for key, c in collected.items()}
    qspec_nones = [c.config for c in collected.values() if c.config.method == "none" and not c.config.baseline]
    nones = {(c.weight_format, c.batch): c.key for c in qspec_nones}
    first_none = qspec_nones[0].key  # the plan puts the primary format's none at its smallest batch first
    checks = []
    for key, c in collected.items():
        reference = _reference(c.config, nones, first_none)
        if reference is None:
            continue
        comparison = compare_outputs(tokens[key], tokens[reference[0]])
        checks.append(EqualityCheck(config=key, reference=reference[0], kind=reference[1], **dict(comparison)))
    return Equality(
        speculative_equal_none=all(c.equal == c.total for c in checks if c.kind == "speculative"),
        all_equal=all(c.equal == c.total for c in checks),
        checks=checks,
    )


def contention_notes(other_cpu: float, round_other_cpu: dict[str, list[float]]) -> list[str]:
    """A note when other processes used more than CONTENTION_NOTE of the CPU, with the worst rounds.

    ``round_other_cpu``: config key -> other processes' share in each of its rounds.
    """
    rounds_hit = [
        (share, key, number + 1)
        for key, shares in round_other_cpu.items()
        for number, share in enumerate(shares)
        if share > CONTENTION_NOTE
    ]
    if other_cpu <= CONTENTION_NOTE and not rounds_hit:
        return []
    worst = ", ".join(f"{key} round {n}: {share:.0%}" for share, key, n in sorted(rounds_hit, reverse=True)[:4])
    return [
        f"other processes used {other_cpu:.0%} of the CPU over the run"
        + (f" (worst: {worst}; {len(rounds_hit)} config-rounds above {CONTENTION_NOTE:.0%})" if rounds_hit else "")
        + ": the machine was shared, so these numbers, ratios included, are not clean; rerun on a quiet machine"
    ]
