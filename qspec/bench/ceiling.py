"""Speculation's ceiling: how much faster than ``none`` a speculative configuration could decode with its
own drafts if it knew, before each call, how many of them the model will accept.

The replay (:func:`replay_drafts`): greedy decoding emits the same tokens whatever is speculated, so
along ``none``'s output the configuration's proposer drafts, at every position, what it would draft
there, and each draft counts as accepted up to its first token that differs from the output. The
oracle (:func:`oracle_ms`) then walks the output choosing at every step how many drafts to verify (up
to the configuration's largest K), paying what a call with that many drafts costs (the micro-benchmark's
prices of the package's compiled Ks, linear in between: the runtime graph runs a row's live tokens
only), so that the whole output takes the least time: a shortest path over positions.

Example, Ks ``[0, 4]`` at 10 / 15 ms, an output of 5 decode tokens whose drafts would be accepted
``[3, 0, 0, 0, 0]`` tokens deep: verifying 3 drafts at position 0 (a K=4 call cut to 4 live tokens,
13.75 ms) reaches position 4 (3 accepted + the bonus token), one K=0 call finishes: 23.75 ms against
``none``'s 5 x 10 = 50 ms, a ceiling of 2.1x.

Its speed-up over ``none`` is the most any dispatch of those drafts can reach on that package; the
configuration's measured decode speed-up (``none``'s time per output token over its own) against it
says what share of the possible gain the dispatch took. A ceiling below a target says that the
drafts, not the dispatch or the graph, are what stands in the way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from qspec.bench.analysis import Collected
from qspec.bench.plan import none_config
from qspec.bench.report import CeilingRow, MicroReport
from qspec.bench.runners import RequestResult
from qspec.runtime.proposers import make_proposer

# Methods whose drafts depend only on the tokens (replayable without a model)
REPLAYABLE = ("pld", "suffix")

Step = tuple[int, int]  # (drafts on offer, of which accepted) at one position


def accepted_depth(drafts: Sequence[int], output: Sequence[int], at: int) -> int:
    """How many of ``drafts`` the greedy ``output`` continues from position ``at``.

    ``accepted_depth([5, 6, 9], [1, 5, 6, 7], 1) == 2``: 5 and 6 match, 9 is not 7.
    """
    depth = 0
    while depth < len(drafts) and at + depth < len(output) and drafts[depth] == output[at + depth]:
        depth += 1
    return depth


def replay_drafts(
    method: str, prompts: Mapping[str, Sequence[int]], outputs: Mapping[str, Sequence[int]], k: int
) -> dict[str, list[Step]]:
    """Per request, ``(drafts on offer, accepted)`` at each decode position ``1 .. len(output) - 1``
    (token 0 comes from the prefill), with ``method``'s proposer at its default knobs offering at most
    ``k`` drafts. Requests replay in the order given (a suffix proposer also learns across requests)."""
    proposer = make_proposer(method)
    replayed = {}
    for rid, output in outputs.items():
        proposer.start(rid, list(prompts[rid]))
        proposer.extend(rid, list(output[:1]))
        steps = []
        for at in range(1, len(output)):
            drafts = [int(t) for t in proposer.propose(rid, k)]
            steps.append((len(drafts), accepted_depth(drafts, output, at)))
            proposer.extend(rid, [output[at]])
        proposer.finish(rid)
        replayed[rid] = steps
    return replayed


def oracle_ms(steps: Sequence[Step], price: Mapping[int, float], max_depth: int) -> tuple[float, int]:
    """``(ms, calls)`` of the fastest way through ``steps`` (one request's :func:`replay_drafts`) when
    each call verifies any number of the drafts on offer up to ``max_depth`` (the configuration's
    largest K), at :func:`call_ms` of that many."""
    n = len(steps)
    best = [(0.0, 0)] * (n + 1)  # best[i]: (ms, calls) from position i to the end
    for i in range(n - 1, -1, -1):
        offered, accepted = steps[i]
        options = []
        for depth in range(min(offered, max_depth) + 1):
            reach = min(i + 1 + min(depth, accepted), n)
            options.append((call_ms(price, depth) + best[reach][0], best[reach][1] + 1))
        best[i] = min(options)
    return best[0]


def call_ms(price: Mapping[int, float], depth: int) -> float:
    """ms of a call verifying ``depth`` drafts: ``price[K]`` at a compiled K, linear between two (the
    runtime graph runs a row's live tokens only, so a draft shorter than its K costs what its tokens
    cost). ``call_ms({0: 10, 4: 18}, 1) == 12.0``."""
    ks = sorted(price)
    return float(np.interp(depth, ks, [price[k] for k in ks]))


def decode_prices(micro: MicroReport | None, weight_format: str) -> dict[int, float] | None:
    """``{K: ms}`` of every decode K of the batch-1 ``weight_format`` package in the micro-benchmark (its
    smallest compute-context-length bucket: the micro times calls at positions up to 255); None when
    it was not timed or has no K=0."""
    if micro is None:
        return None
    package = next(
        (p for p in micro.packages if p.batch == 1 and p.weight_format == weight_format and p.graph == "runtime"),
        None,
    )
    if package is None:
        return None
    prices: dict[int, float] = {}
    for call in package.calls:  # "K=4" or "K=4@256", buckets in ascending order
        name = call.specialization.split("@")[0]
        if name.startswith("K="):
            prices.setdefault(int(name[2:]), call.median_ms)
    return prices if 0 in prices else None


def decode_ms_per_token(requests: Mapping[str, RequestResult]) -> float | None:
    """Σ decode time / Σ decode tokens (every token after the first) of ``requests``, in ms."""
    tokens = sum(len(r.tokens) - 1 for r in requests.values())
    seconds = sum(r.metrics.e2e_s - r.metrics.ttft_s for r in requests.values())
    return seconds * 1000 / tokens if tokens > 0 else None


def ceilings(
    collected: Mapping[str, Collected], prompts: Mapping[str, Sequence[int]], micro: MicroReport | None
) -> list[CeilingRow]:
    """One row per replayable speculative qspec configuration at batch 1, over its first-turn requests
    (``prompts``: their token ids): its ceiling over ``none`` of its weight format, the decode speed-up
    it measured (``none``'s decode ms per token over its own), and the share of the possible gain it took."""
    rows = []
    for key, c in collected.items():
        config = c.config
        if config.baseline or config.batch != 1 or config.method not in REPLAYABLE or not any(config.ks):
            continue
        none = collected.get(none_config(config.weight_format, 1).key)
        price = decode_prices(micro, config.weight_format)
        if none is None or price is None or max(config.ks) > max(price):
            continue
        first = {rid: result for rid, (_, result) in none.requests.items() if rid in prompts}
        own = {rid: result for rid, (_, result) in c.requests.items() if rid in first}
        replayed = replay_drafts(config.method, prompts, {rid: r.tokens for rid, r in first.items()}, max(config.ks))
        positions = sum(len(steps) for steps in replayed.values())
        none_ms, own_ms = decode_ms_per_token(first), decode_ms_per_token(own)
        if not positions or none_ms is None or own_ms is None:
            continue
        oracle = [oracle_ms(steps, price, max(config.ks)) for steps in replayed.values()]
        ceiling = positions * price[0] / sum(ms for ms, _ in oracle)
        measured = none_ms / own_ms
        rows.append(
            CeilingRow(
                key=key,
                weight_format=config.weight_format,
                ks=list(config.ks),
                positions=positions,
                drafted_positions=sum(1 for steps in replayed.values() for offered, _ in steps if offered),
                oracle_calls=sum(calls for _, calls in oracle),
                oracle_x_none=round(ceiling, 3),
                measured_x_none=round(measured, 3),
                captured=round((measured - 1) / (ceiling - 1), 2) if ceiling > 1 else None,
            )
        )
    return rows
