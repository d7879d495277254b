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

At batch B > 1 the same walk runs per row at the batch-B package's prices (its calls timed with every row
live, each row paying a 1/B share, which leaves the ratio to ``none`` as it is), a row verifying its own count
(linear in between: ragged rows, :mod:`qspec.runtime.layout`); a head's calls cost the batch-B head call's
share. Example, batch 4, Ks ``[0, 4]`` at 16 / 56 ms: a row-step costs 4 ms plus 2.5 ms a verified draft, so a
draft pays only if accepted more often than 2.5 / 4 of the time, and endless accepted drafts reach at most
16 / (4 x 2.5) = 1.6x: at batch B the call's fixed part, shared by B rows, is the most speculation can save.

Its speed-up over ``none`` is the most any dispatch of those drafts can reach on that package; the
configuration's measured decode speed-up (``none``'s time per output token over its own) against it
says what share of the possible gain the dispatch took. A ceiling below a target says that the
drafts, not the dispatch or the graph, are what stands in the way.

Head drafts (``eagle``, ``medusa``, their ``+pld``) depend on the target's hidden states too, which are
as deterministic as its greedy tokens: :func:`target_hidden_states` runs the package's target once over
a request's prompt and ``none``'s output (prefill calls), and :func:`replay` hands the head proposer the
hidden state of each position as the engine would after a verify call. Two differences from the run,
said in the report: the hidden states come from prefill-shaped calls, not verify calls (float sums in
another order: a near-tie of the head's argmax can flip), and the oracle also pays for the head's calls
(:func:`head_draft_ms`, at the micro-benchmark's prices).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from qspec.bench.analysis import Collected
from qspec.bench.plan import none_config
from qspec.bench.report import CeilingRow, MicroReport
from qspec.bench.runners import RequestResult
from qspec.runtime.proposal import Proposer
from qspec.runtime.proposers import make_proposer

# Methods whose drafts depend only on the tokens (replayable without a model)
REPLAYABLE = ("pld", "suffix")

Step = tuple[int, int]  # (drafts on offer, of which accepted) at one position
HeadReplay = tuple[list[Step], list[tuple[float, ...]]]  # the steps of all requests, ms of d drafts at each


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
    replayed = replay(make_proposer(method), prompts, outputs, k)
    return {rid: [step for step, _ in steps] for rid, steps in replayed.items()}


def replay(
    proposer: Proposer,
    prompts: Mapping[str, Sequence[int]],
    outputs: Mapping[str, Sequence[int]],
    k: int,
    hidden: Mapping[str, np.ndarray] | None = None,
) -> dict[str, list[tuple[Step, int]]]:
    """Per request, ``((drafts on offer, accepted), match_len)`` at each decode position, ``proposer`` fed
    as the engine feeds it. ``hidden``: per request ``[positions, hidden]`` (:func:`target_hidden_states`)
    for a proposer that reads hidden states: the prompt's before the first step, then position ``p``'s
    once the token after it is emitted (a verify call computes it)."""
    replayed = {}
    for rid, output in outputs.items():
        prompt = list(prompts[rid])
        proposer.start(rid, prompt)
        if hidden is not None:
            proposer.observe_hidden(rid, 0, hidden[rid][: len(prompt)])
        proposer.extend(rid, list(output[:1]))
        steps = []
        for at in range(1, len(output)):
            proposal = proposer.propose_batch([(rid, k)])[0]
            drafts = [int(t) for t in proposal.tokens]
            steps.append(((len(drafts), accepted_depth(drafts, output, at)), proposal.match_len))
            if hidden is not None:  # position len(prompt) + at - 1 holds output[at - 1]
                p = len(prompt) + at - 1
                proposer.observe_hidden(rid, p, hidden[rid][p : p + 1])
            proposer.extend(rid, [output[at]])
        proposer.finish(rid)
        replayed[rid] = steps
    return replayed


def target_hidden_states(model, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
    """``[positions, hidden]``: the target's hidden state at every position of ``prompt + output[:-1]``, from
    prefill calls of ``model`` (a loaded package with the ``hidden_states`` output) into KV slot 0."""
    from qspec.runtime.prefill import PrefillRow, run_prefill

    tokens = [*prompt, *output[:-1]]
    pieces: dict[int, np.ndarray] = {}

    def keep(i: int, start: int, hidden: np.ndarray) -> None:
        pieces[start] = np.array(hidden, np.float32)  # a view of the call's output buffer: the next call reuses it

    run_prefill(model, [PrefillRow(0, tokens)], lambda i, logits: None, keep)
    return np.concatenate([pieces[start] for start in sorted(pieces)])[: len(tokens)]


def head_call_ms(micro: MicroReport | None, weight_format: str, batch: int = 1) -> tuple[str, float] | None:
    """``(method, ms)`` of a row's share of the batch-``batch`` ``weight_format`` package's head step: EAGLE's
    ``seq_len=1`` call, Medusa's ``batch=B`` call, over ``batch``; None when the micro-benchmark did not time it."""
    heads = micro.heads if micro else []
    head = next((h for h in heads if h.batch == batch and h.weight_format == weight_format), None)
    wanted = "seq_len=1" if head and _chained(head.method) else f"batch={batch}"
    call = next((c for c in head.calls if c.specialization == wanted), None) if head else None
    return (head.method, call.median_ms / batch) if call else None


def head_draft_ms(method: str, call_ms: float, offered: int, from_head: bool) -> tuple[float, ...]:
    """ms to obtain ``d = 0 .. offered`` drafts at one position: nothing for no draft or lookup's drafts;
    EAGLE one head call per draft (its catch-up priced as a one-token call), Medusa one call for any d.
    ``head_draft_ms("eagle", 2.0, 3, True) == (0.0, 2.0, 4.0, 6.0)``."""
    if not from_head:
        return (0.0,) * (offered + 1)
    chained = _chained(method)
    return tuple(0.0 if d == 0 else call_ms * (d if chained else 1) for d in range(offered + 1))


def _chained(method: str) -> bool:
    """The head method calls its graph once per draft (EAGLE), not once for all (Medusa)."""
    from qspec.runtime.heads import head_proposer

    return head_proposer(method).chained


def replay_head(
    proposer: Proposer,
    prompts: Mapping[str, Sequence[int]],
    outputs: Mapping[str, Sequence[int]],
    hidden: Mapping[str, np.ndarray],
    k: int,
    *,
    method: str,
    call_ms: float,
    lookup_min_match: int | None = None,
) -> dict[str, HeadReplay]:
    """Per request, the steps of a head proposer (``lookup_min_match``: of ``eagle+pld``, whose drafts after a
    match that long are lookup's, free) and what its drafts cost at each step."""
    out = {}
    for rid, steps in replay(proposer, prompts, outputs, k, hidden).items():
        costs = []
        for (offered, _), match_len in steps:
            from_head = lookup_min_match is None or match_len < lookup_min_match
            costs.append(head_draft_ms(method, call_ms, offered, from_head))
        out[rid] = ([step for step, _ in steps], costs)
    return out


def oracle_ms(
    steps: Sequence[Step],
    price: Mapping[int, float],
    max_depth: int,
    draft_ms: Sequence[Sequence[float]] | None = None,
) -> tuple[float, int]:
    """``(ms, calls)`` of the fastest way through ``steps`` (one request's :func:`replay_drafts`) when
    each call verifies any number of the drafts on offer up to ``max_depth`` (the configuration's
    largest K), at :func:`call_ms` of that many, plus ``draft_ms[i][depth]`` when drafting costs (a head)."""
    n = len(steps)
    best = [(0.0, 0)] * (n + 1)  # best[i]: (ms, calls) from position i to the end
    for i in range(n - 1, -1, -1):
        offered, accepted = steps[i]
        options = []
        for depth in range(min(offered, max_depth) + 1):
            reach = min(i + 1 + min(depth, accepted), n)
            drafting = draft_ms[i][depth] if draft_ms is not None else 0.0
            options.append((call_ms(price, depth) + drafting + best[reach][0], best[reach][1] + 1))
        best[i] = min(options)
    return best[0]


def call_ms(price: Mapping[int, float], depth: int) -> float:
    """ms of a call verifying ``depth`` drafts: ``price[K]`` at a compiled K, linear between two (the
    runtime graph runs a row's live tokens only, so a draft shorter than its K costs what its tokens
    cost). ``call_ms({0: 10, 4: 18}, 1) == 12.0``."""
    ks = sorted(price)
    return float(np.interp(depth, ks, [price[k] for k in ks]))


def decode_prices(micro: MicroReport | None, weight_format: str, batch: int = 1) -> dict[int, float] | None:
    """``{K: ms}`` of every decode K of the batch-``batch`` ``weight_format`` package in the micro-benchmark (its
    smallest compute-context-length bucket: the micro times calls at positions up to 255, every row live);
    None when it was not timed or has no K=0."""
    if micro is None:
        return None
    package = next(
        (p for p in micro.packages if p.batch == batch and p.weight_format == weight_format and p.graph == "runtime"),
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
    collected: Mapping[str, Collected],
    prompts: Mapping[str, Sequence[int]],
    micro: MicroReport | None,
    head_replays: Mapping[str, dict[str, HeadReplay]] | None = None,
) -> list[CeilingRow]:
    """One row per replayable speculative qspec configuration, over its first-turn requests (``prompts``: their
    token ids): its ceiling over ``none`` of its weight format and batch size (module doc), the decode speed-up
    it measured (``none``'s decode ms per token over its own), and the share of the possible gain it took.
    ``head_replays``: config key -> :func:`replay_head` of a head configuration (replayed while the run's
    models were loaded: :func:`head_replays_of`)."""
    head_replays = head_replays or {}
    rows = []
    for key, c in collected.items():
        config = c.config
        replayable = config.method in REPLAYABLE or key in head_replays
        if config.baseline or not replayable or not any(config.ks):
            continue
        none = collected.get(none_config(config.weight_format, config.batch).key)
        price = decode_prices(micro, config.weight_format, config.batch)
        if none is None or price is None or max(config.ks) > max(price):
            continue
        first = {rid: result for rid, (_, result) in none.requests.items() if rid in prompts}
        own = {rid: result for rid, (_, result) in c.requests.items() if rid in first}
        costs: dict[str, list] = {}
        if key in head_replays:
            replayed = {rid: steps for rid, (steps, _) in head_replays[key].items() if rid in first}
            costs = {rid: cost for rid, (_, cost) in head_replays[key].items()}
        else:
            outputs = {rid: r.tokens for rid, r in first.items()}
            replayed = replay_drafts(config.method, prompts, outputs, max(config.ks))
        positions = sum(len(steps) for steps in replayed.values())
        none_ms, own_ms = decode_ms_per_token(first), decode_ms_per_token(own)
        if not positions or none_ms is None or own_ms is None:
            continue
        oracle = [oracle_ms(steps, price, max(config.ks), costs.get(rid)) for rid, steps in replayed.items()]
        # rounded as reported: a ceiling of 1 + 1e-15 (no draft worth verifying) captures nothing, not -1e15
        ceiling = round(positions * price[0] / sum(ms for ms, _ in oracle), 3)
        measured = none_ms / own_ms
        rows.append(
            CeilingRow(
                key=key,
                weight_format=config.weight_format,
                ks=list(config.ks),
                positions=positions,
                drafted_positions=sum(1 for steps in replayed.values() for offered, _ in steps if offered),
                oracle_calls=sum(calls for _, calls in oracle),
                oracle_x_none=ceiling,
                measured_x_none=round(measured, 3),
                captured=round((measured - 1) / (ceiling - 1), 2) if ceiling > 1 else None,
                replay="hidden states" if key in head_replays else "tokens",
            )
        )
    return rows


def head_replays_of(
    configs, models: Mapping, collected: Mapping[str, Collected], prompts: Mapping[str, Sequence[int]], micro
) -> dict[str, dict[str, HeadReplay]]:
    """:func:`replay_head` of every head configuration whose package's head the micro-benchmark priced, along
    ``none``'s first-turn outputs of its weight format and batch size; ``models``: (weight format, batch) -> the
    run's loaded model (its KV slot 0 is overwritten: call between runs).

    A head's drafts with a cap of k are the first k of its drafts with a larger cap (a chain or a row of
    Medusa heads cut short), and the oracle never verifies more than a configuration's largest K: so
    ``eagle`` and ``medusa`` replay once per weight format, at their deepest K list. ``+pld`` replays per K list (the
    lookup picks its match by the continuation it can offer, which depends on the cap)."""
    from qspec.runtime.proposers import HEAD_METHODS

    wanted = [
        c
        for c in configs
        if c.method in HEAD_METHODS
        and any(c.ks)
        and (c.weight_format, c.batch) in models
        and none_config(c.weight_format, c.batch).key in collected
        and head_call_ms(micro, c.weight_format, c.batch)
    ]
    deepest: dict[tuple[str, str, int], int] = {}
    for c in wanted:
        at = (c.method, c.weight_format, c.batch)
        deepest[at] = max(deepest.get(at, 0), max(c.ks))
    hidden_by_package: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    done: dict[tuple[str, str, int, int], dict[str, HeadReplay]] = {}
    out = {}
    for c in wanted:
        package = (c.weight_format, c.batch)
        k = max(c.ks) if c.method.endswith("+pld") else deepest[(c.method, *package)]
        at = (c.method, *package, k)
        if at not in done:
            model = models[package]
            none = collected[none_config(*package).key]
            outputs = {rid: r.tokens for rid, (_, r) in none.requests.items() if rid in prompts}
            if package not in hidden_by_package:
                hidden_by_package[package] = {
                    rid: target_hidden_states(model, prompts[rid], tokens) for rid, tokens in outputs.items()
                }
            done[at] = _replay_config(c.method, model, prompts, outputs, hidden_by_package[package], k, micro, *package)
        out[c.key] = done[at]
    return out


def _replay_config(method, model, prompts, outputs, hidden, k: int, micro, weight_format: str, batch: int):
    """One head method's :func:`replay_head` on ``model``'s package with a fresh proposer."""
    from qspec.runtime.lookup_first import LookupFirstProposer

    proposer = make_proposer(method, package=model.package)
    proposer.check_target(vocab_size=model.vocab_size, ctx_len=model.ctx_len, num_slots=1)
    min_match = proposer.min_match if isinstance(proposer, LookupFirstProposer) else None
    head, ms = head_call_ms(micro, weight_format, batch)
    return replay_head(proposer, prompts, outputs, hidden, k, method=head, call_ms=ms, lookup_min_match=min_match)
