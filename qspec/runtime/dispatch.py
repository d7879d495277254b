"""Which compiled K a decode step runs: the :class:`Dispatcher` (the modes and when ``auto`` picks which).

``cover`` (:func:`pick_k`): the smallest K that covers the batch's longest proposal.

``cost``: the K with the most expected tokens per millisecond, each row's drafts cut to the depth
that pays (:func:`plan_by_cost`). With several sequences in flight one long proposal would otherwise
make every row pay for ``seq_len = K + 1``; on a CPU a batch-4 K=4 call costs about twice a K=0 call.
Expected tokens use running estimates of ``c_i``, the chance that draft ``i`` is accepted given that
drafts ``1..i-1`` were, kept per proposal class (:class:`AcceptanceStats`: a prompt-lookup draft
after a 3-gram match is accepted far more often than one after a 1-gram match)::

    tokens = Σ_rows [1 + Σ_{i ≤ depth_row} c_1 · … · c_i]       rate = tokens / cost(K, live tokens)

Example: Ks ``[0, 4]``, costs 40 / 80 ms, two rows with 4 and 0 drafts, every ``c_i = 0.5``:
K=0 gives 2 tokens / 40 ms = 0.050; K=4 gives 2 + (0.5 + 0.25 + 0.125 + 0.0625) = 2.94 tokens /
80 ms = 0.037, so K=0 runs and the drafts are dropped. With ``c_i = 0.9`` K=4 gives 5.10 / 80 =
0.064 and wins. Cutting drafts never changes the output, only the speed.

The costs start as the warm-up's calls and then follow the engine's own calls (:class:`CallCosts`):
a padding call skips attention, and a few calls at start-up on a noisy machine misprice a K for the
whole run (the measurements behind this module's rules: ``docs/measurements.md``).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from qspec.errors import ConfigError
from qspec.runtime.acceptance import AcceptanceStats, DraftGate, SiblingStats, SurvivalStats

__all__ = ["AcceptanceStats", "CallCosts", "Dispatcher", "plan_by_cost", "pick_k", "pick_k_by_cost"]

if TYPE_CHECKING:
    from qspec.runtime.proposal import Proposal

DISPATCH_MODES = ("auto", "cover", "cost")  # what each one does: Dispatcher
# A larger K must promise 10 % more tokens per ms than the best smaller one: the estimate is high for
# Ks that rarely run, and a K run on a high estimate costs more than it gives.
MARGIN = 1.1
# Cost dispatch drops drafts it expects to be rejected, and then learns nothing more about them: after
# this many steps with drafts on offer and none verified, one step verifies one draft a row (a few
# early rejections would otherwise price the drafts out for the whole run).
EXPLORE_EVERY = 8


def check_mode(mode: str) -> str:
    """``mode`` if it is a dispatch mode, else a ConfigError naming them."""
    if mode not in DISPATCH_MODES:
        raise ConfigError(f"dispatch {mode!r}: use {', '.join(DISPATCH_MODES)}")
    return mode


def pick_k(ks: Sequence[int], proposed: int) -> int:
    """``cover``: the smallest compiled K that covers ``proposed`` drafts (the largest K if none does).

    ``pick_k([0, 4], 0) == 0``, ``pick_k([0, 4], 2) == 4``, ``pick_k([1, 4], 0) == 1``.
    """
    i = bisect.bisect_left(ks, proposed)
    return ks[min(i, len(ks) - 1)]


def restrict_ks(compiled: Sequence[int], requested: Sequence[int] | str | None) -> list[int]:
    """The Ks dispatch may pick: ``requested`` (which must all be compiled), or every compiled K."""
    if requested is None:
        return list(compiled)
    from qspec.specializations import parse_num_speculative_tokens

    subset = list(parse_num_speculative_tokens(requested))
    missing = [k for k in subset if k not in compiled]
    if missing:
        raise ConfigError(
            f"num_speculative_tokens {missing} not compiled in this package (it has {list(compiled)}); "
            "pick from those or recompile with them"
        )
    return subset


def _interleaved_ms(model, calls: Sequence[tuple[object, int | None]], repeats: int) -> list[float]:
    """Median ms of each ``(binding, live tokens a row or None: padding)`` call over ``repeats`` rounds,
    one call of each per round: a slow stretch of a shared machine lands on every call alike."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for (bound, live), took in zip(calls, times):
            if live is not None:
                bound.fill_live(live)
            begin = time.perf_counter()
            model.run(bound)
            took.append((time.perf_counter() - begin) * 1000)
    for bound, live in calls:
        if live is not None:
            bound.reset()
    return [float(np.median(took)) for took in times]


def measure_costs(model, ks: Sequence[int], repeats: int) -> dict[int, float]:
    """Median ms of a call of each K's decode specialization on padding, over ``repeats`` rounds."""
    return dict(zip(ks, _interleaved_ms(model, [(model.decode[k], None) for k in ks], repeats)))


def measure_live_costs(model, ks: Sequence[int], repeats: int) -> CallCosts:
    """Prices for a graph whose MatMuls run on live tokens only: each K's call with every row live
    (``K + 1`` tokens a row), and the largest K's with one live token a row, which gives the price of a
    live token. Writes the first slots of every KV row (before any request is in flight)."""
    top = ks[-1]
    calls = [(model.decode[k], k + 1) for k in ks] + [(model.decode[top], 1)]
    *measured, one_live = _interleaved_ms(model, calls, repeats)
    full = dict(zip(ks, measured))
    rows = model.decode[top].spec.batch_size
    per_token = max(0.0, (full[top] - one_live) / (rows * top)) if top else 0.0
    return CallCosts(full, per_token=per_token, measured_tokens={k: rows * (k + 1) for k in ks})


def expected_tokens(depths: Sequence[int], chains: Sequence[np.ndarray]) -> float:
    """Tokens a call produces in expectation: one per row plus its accepted drafts.

    Row ``r`` verifies ``depths[r]`` drafts; ``chains[r][i - 1]`` is the chance that its drafts
    ``1..i`` are all accepted.
    """
    return float(sum(1.0 + float(np.sum(chain[:depth])) for depth, chain in zip(depths, chains)))


def plan_by_cost(
    ks: Sequence[int], price: Callable[[int, int], float], lengths: Sequence[int], chains: Sequence[np.ndarray]
) -> tuple[int, list[int]]:
    """``(K, depths)``: row ``r`` verifies its first ``depths[r]`` drafts in a call of K (the smallest
    compiled K covering them), the plan with the most expected tokens per ms; a plan of a larger K
    must beat the best one so far by :data:`MARGIN`. ``price(K, live_tokens)``: ms of a call;
    ``chains[r]``: row ``r``'s acceptance chain (:meth:`AcceptanceStats.chain`).

    Draft ``i`` of row ``r`` adds ``chains[r][i - 1]`` expected tokens for one live token. For each
    compiled K the plans worth pricing are the prefixes of the drafts it can hold, sorted by that gain
    (a row's chain only falls, so a prefix never takes a draft without those before it). Example,
    Ks ``[0, 4]``, a live token 1 ms on a 10 ms call, rows with 4 drafts at chain ``[0.9, 0.8, 0.2,
    0.1]`` and 4 at ``[0.3, 0.1, ...]``: the first row's two drafts and the second row's first pay
    (2 + 0.9 + 0.8 + 0.3 = 4.0 tokens / 15 ms beats 3.7 / 14 without the last, and 4.2 / 16
    with the first row's third), the rest does not.

    On a graph that pads every row to ``K + 1`` tokens the price depends on K only, and every draft a K
    holds is free in it. On a graph whose MatMuls run on live tokens only (the runtime graph:
    ``pack_tokens`` or ``trim_rows`` of :func:`qspec.backends.ort_attention.fuse_attention`) a row's
    drafts cost what they are: rows are cut to different depths, between two compiled Ks too.
    """
    rows = len(lengths)
    drafts = [  # (gain, depth, row) of every draft on offer, the most likely first
        (float(chain[i]), i + 1, r)
        for r, (n, chain) in enumerate(zip(lengths, chains))
        for i in range(min(n, len(chain)))
    ]
    drafts.sort(key=lambda draft: (-draft[0], draft[1]))
    cover = pick_k(ks, max((depth for _, depth, _ in drafts), default=0))
    plans = [(pick_k(ks, 0), [0] * rows, float(rows))]  # (K, depths, expected tokens): no draft verified first
    for cap in (k for k in ks if k <= cover):
        depths, tokens, deepest = [0] * rows, float(rows), 0
        for gain, depth, r in drafts:
            if depth <= cap:
                depths[r], tokens, deepest = depth, tokens + gain, max(deepest, depth)
                plans.append((pick_k(ks, deepest), list(depths), tokens))
    best, best_rate = (ks[0], [0] * rows), -1.0
    for k, depths, tokens in sorted(plans, key=lambda plan: plan[0]):
        rate = tokens / price(k, rows + sum(depths))
        margin = MARGIN if k > best[0] else 1.0  # a larger K must earn the margin; more drafts in the same K need not
        if rate > best_rate * margin + 1e-12:
            best, best_rate = (k, depths), rate
    return best


def pick_k_by_cost(ks: Sequence[int], costs_ms: Mapping[int, float], lengths: Sequence[int], chain: np.ndarray) -> int:
    """The compiled K with the highest expected tokens per ms at a price per K (:func:`plan_by_cost`,
    every row on ``chain``), at most the ``cover`` K; a larger K must beat the best smaller one by
    :data:`MARGIN`.

    A K above the one covering the longest proposal adds no token, only padding, even when a noisy
    warm-up measured it cheaper.
    """
    return plan_by_cost(ks, lambda k, live: costs_ms[k], lengths, [chain] * len(lengths))[0]


class CallCosts(Mapping[int, float]):
    """Each K's price in ms for ``cost`` dispatch: the median of its last ``window`` calls, seeded with
    the warm-up's measurement, so the price is what calls really cost (their positions, live rows and
    attention) and one slow call does not move it.

    ``per_token``: ms a live token adds to a call whose MatMuls run on live tokens only; then a K's
    price is ``self[K] + per_token * live_tokens``, its median taken over the calls' remainders.
    ``measured_tokens``: the live tokens of the measured calls (default: none).
    """

    def __init__(self, measured: Mapping[int, float], window: int = 9, *, per_token: float = 0.0, measured_tokens=None):
        self.per_token = float(per_token)
        tokens = measured_tokens or {}
        base = {k: float(ms) - self.per_token * tokens.get(k, 0) for k, ms in measured.items()}
        self._recent = {k: deque([ms], maxlen=window) for k, ms in base.items()}
        self._price = dict(base)

    def observe(self, k: int, ms: float, live_tokens: int = 0) -> None:
        recent = self._recent[k]
        recent.append(ms - self.per_token * live_tokens)
        self._price[k] = _median(recent)

    def price(self, k: int, live_tokens: int) -> float:
        """ms of a call of K with ``live_tokens`` live tokens."""
        return self._price[k] + self.per_token * live_tokens

    def __getitem__(self, k: int) -> float:
        return self._price[k]

    def __iter__(self) -> Iterator[int]:
        return iter(self._price)

    def __len__(self) -> int:
        return len(self._price)


def _median(values) -> float:
    """The median of a few numbers (``np.median`` costs ~30 µs a call, once per decode step)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return float(ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2)


class Dispatcher:
    """The dispatch state of one engine: its mode, the prices of its calls and the acceptance it has seen.

    ``plan(proposals, greedy=...)`` picks each step's K and per-row depths; ``observe_call`` and
    ``observe_acceptance`` feed it what the engine's calls cost and accepted. Modes:

    - ``cover``: the smallest K covering the longest proposal (:func:`pick_k`); needs no prices.
    - ``cost``: the plan with the most expected tokens per ms (:func:`plan_by_cost`).
    - ``auto``: ``cost`` for steps whose rows are all greedy, ``cover`` when one samples (a seeded
      sampled request must give the same tokens every run, and ``cost`` follows measured times).
      :meth:`for_model` resolves ``auto`` to ``cover`` on one KV slot of a graph that pads every row to
      ``K + 1`` tokens: there every draft up to the K it runs is free, so covering them costs nothing.

    ``prices`` (ms of a call of each K, :class:`CallCosts`) is needed by ``cost`` and ``auto`` only.
    """

    def __init__(
        self, ks: Sequence[int], *, mode: str = "cover", k_max: int | None = None, prices: CallCosts | None = None
    ):
        self.ks = list(ks)
        self.k_max = self.ks[-1] if k_max is None else k_max
        if check_mode(mode) != "cover" and self.k_max > 0 and prices is None:
            raise ConfigError(f"dispatch {mode!r} needs the prices of the calls (CallCosts); use cover without them")
        self.mode = mode
        self.prices = prices
        self.stats = AcceptanceStats(self.k_max)  # proposals without probabilities: per class
        self.survival = SurvivalStats()  # proposals with them (a head's): calibrated
        self.siblings = SiblingStats()  # a tree's drafts off the chain
        self.gate = DraftGate()
        self.rate = 0.0  # expected tokens per ms of the last cost plan (0: none yet)
        self._unverified = 0  # cost plans since drafts were last verified (EXPLORE_EVERY)
        self._drafting: set = set()  # requests the gate let draft this step

    @classmethod
    def for_model(
        cls, model, ks: Sequence[int], *, mode: str, k_max: int, num_slots: int, repeats: int = 7
    ) -> Dispatcher:
        """The dispatcher of an engine running ``num_slots`` sequences on ``model`` (warmed up): ``auto``
        resolved, prices measured when the mode may use them (calls of every K, interleaved; on a graph
        that runs live tokens only, also the price of a live token: :func:`measure_live_costs`)."""
        if check_mode(mode) == "auto" and num_slots == 1 and not model.packs_live_tokens:
            mode = "cover"
        prices = None
        if mode != "cover" and k_max > 0:
            if model.packs_live_tokens:
                prices = measure_live_costs(model, ks, repeats)
            else:
                prices = CallCosts(measure_costs(model, ks, repeats))
        return cls(ks, mode=mode, k_max=k_max, prices=prices)

    def step_mode(self, *, greedy: bool) -> str:
        """``cover`` or ``cost`` for a step whose rows are all greedy (``greedy``) or not."""
        if self.mode != "auto":
            return self.mode
        return "cost" if greedy else "cover"

    def chain(self, proposal: Proposal) -> np.ndarray:
        """The expected tokens each of the proposal's drafts adds, in its layout's order, as cost dispatch prices
        it: along the top-1 chain its survival, its drafter's probabilities calibrated (:class:`SurvivalStats`)
        when it has them, else its class's measured ``c_i`` (:class:`AcceptanceStats`); a draft off the chain
        (a tree's sibling of the first draft) the chance that the first draft fails and it passes
        (:class:`SiblingStats`), never more than the draft before it (a plan takes a prefix of the layout)."""
        if proposal.parents is None:  # a chain
            if proposal.survival is not None:
                return self.survival.chain(proposal.survival)
            return self.stats.chain(proposal.dispatch_class)
        layout = proposal.layout
        n = layout.chain_len
        if proposal.survival is not None:
            chain = self.survival.chain(proposal.survival[:n])
        else:
            chain = self.stats.chain(proposal.dispatch_class)[:n]
        if layout.is_chain:
            return chain
        head = proposal.survival[n:] if proposal.survival is not None else None
        first = float(chain[0]) if n else 0.0
        rest = self.siblings.gains(len(layout) - n, first, head)
        return np.minimum.accumulate(np.concatenate([chain, rest]))

    def plan(self, proposals: Sequence[Proposal], *, greedy: bool) -> tuple[int, list[int]]:
        """``(K, depths)``: the call to run and how many drafts each row verifies in it (one budget across the
        rows: every row's drafts compete by survival, :func:`plan_by_cost`)."""
        lengths = [len(p) for p in proposals]
        if self.k_max == 0:  # `none`: nothing to verify, nothing to plan
            return self.ks[0], lengths
        if self.step_mode(greedy=greedy) != "cost":
            k = pick_k(self.ks, max(lengths))
            return k, [min(n, k) for n in lengths]
        chains = [self.chain(p) for p in proposals]
        k, depths = plan_by_cost(self.ks, self.prices.price, lengths, chains)
        trials = self.gate.trials if len(self.gate.trials) == len(lengths) else [False] * len(lengths)
        if any(t and n and not d for t, n, d in zip(trials, lengths, depths)):
            # A gate's trial step measures whether the row's drafting pays again: it verifies at least one draft,
            # or a row priced out once would never be measured again.
            depths = [max(d, min(n, 1)) if t else d for t, n, d in zip(trials, lengths, depths)]
            k = max(k, pick_k(self.ks, max(depths)))
        self.rate = expected_tokens(depths, chains) / self.prices.price(k, len(lengths) + sum(depths))
        if any(depths):
            self._unverified = 0
        elif any(lengths):
            self._unverified += 1  # plans with drafts on offer that verified none
            if self._unverified >= EXPLORE_EVERY:
                self._unverified = 0
                return pick_k(self.ks, 1), [min(n, 1) for n in lengths]
        return k, depths

    def useful_depth(self, proposal: Proposal, cap: int, greedy: bool = True, draft_ms: float = 0.0) -> int:
        """How many of ``cap`` drafts a ``cost`` step would verify of a proposal like ``proposal`` (the drafts a
        head has made so far, further ones assumed as likely as its last), when each draft not yet made costs
        ``draft_ms`` more (a chained head call); ``cap`` when the step covers its drafts. A head asks after each
        draft whether the next one can pay (:meth:`Proposer.limit_depth`): it stops as soon as the answer is
        not more than it has.

        Two tests, both must pass: the :func:`plan_by_cost` of the row alone, and, once a plan ran, the
        marginal one: a draft not yet made adds its survival in tokens for ``per_token + draft_ms`` ms, which
        must beat the last plan's tokens per ms (:attr:`rate`; with other rows in flight that rate is theirs
        too). Example: last plan 0.2 tokens / ms, a live token 1 ms, a head call 0.5 ms: after a first draft
        of survival 0.5 a second one is expected at 0.25 and adds 0.25 / 1.5 = 0.17 tokens / ms: it is not made
        (were head calls free, 0.25 / 1 = 0.25 would pay); after one of 0.67, at 0.45 (0.3 tokens / ms), it is.
        """
        if cap <= 0 or self.k_max == 0 or self.step_mode(greedy=greedy) != "cost":
            return max(cap, 0)
        made = len(proposal)
        chain = self.chain_ahead(proposal, cap)
        price = self.prices.price

        def with_drafting(k: int, live: int) -> float:
            return price(k, live) + draft_ms * max(0, live - 1 - made)

        depth = plan_by_cost(self.ks, with_drafting, [cap], [chain])[1][0]
        if self.rate > 0:
            cost = self.prices.per_token + draft_ms
            depth = next((i for i in range(made, depth) if chain[i] < self.rate * cost), depth)
        return depth

    def chain_ahead(self, proposal: Proposal, cap: int) -> np.ndarray:
        """:meth:`chain` of ``proposal`` up to ``cap`` drafts: a head's drafts not yet made at its last draft's
        calibrated rate (``[0.9, 0.6]`` to 4: ``[0.9, 0.6, 0.4, 0.27]``); a class's chain as it is."""
        if proposal.survival is None:
            return self.stats.chain(proposal.dispatch_class)[:cap]
        chain = self.chain(proposal)[:cap]
        if len(chain) >= cap:
            return chain
        last = chain[-1] / chain[-2] if len(chain) > 1 else chain[-1]
        return np.concatenate([chain, chain[-1] * last ** np.arange(1, cap - len(chain) + 1)])

    def drafting(self, keys: Sequence, *, greedy: bool) -> list[bool]:
        """Which requests draft this step: all, but on a ``cost`` step only those whose drafting pays
        (:class:`DraftGate`: the ms their accepted drafts save against the ms drafting and verifying them costs)."""
        self._drafting, self.gate.trials = set(), []
        if self.k_max == 0 or self.step_mode(greedy=greedy) != "cost":
            return [True] * len(keys)
        if len(self.gate) > 4 * len(keys) + 16:  # finished requests
            self.gate.forget(keys)
        ms_per_token = self.prices.price(self.ks[0], len(keys)) / max(len(keys), 1)
        open_ = self.gate.open(keys, ms_per_token=ms_per_token, per_token=self.prices.per_token)
        self._drafting = {key for key, on in zip(keys, open_) if on}
        return open_

    def observe_drafting(self, ms: float, rows: int) -> None:
        """A step's drafting took ``ms`` for ``rows`` requests (those :meth:`drafting` let draft)."""
        self.gate.observe_drafting(ms, rows)

    def observe_row(self, key, proposal: Proposal, path: Sequence[int]) -> None:
        """Request ``key`` verified ``proposal`` (as cut by the plan) and the drafts of ``path`` passed (a chain's
        first ``len(path)``; a tree's walk, :meth:`~qspec.runtime.layout.VerifyLayout.walk_greedy`)."""
        if key in self._drafting:
            self.gate.observe(key, len(proposal), len(path))
        if len(proposal) == 0:
            return
        if proposal.parents is None:  # a chain
            if proposal.survival is not None:
                self.survival.observe(proposal.survival, len(path))
            else:
                self.stats.observe(len(proposal), len(path), proposal.dispatch_class)
            return
        layout = proposal.layout
        n = layout.chain_len
        on_chain = next((i for i, node in enumerate(path) if node != i), len(path))  # accepted along the chain
        if proposal.survival is not None:
            self.survival.observe(proposal.survival[:n], on_chain)
        else:
            self.stats.observe(n, on_chain, proposal.dispatch_class)
        if not layout.is_chain:
            sibling_passed = bool(path) and path[0] >= n
            self.siblings.observe(len(layout) - n, first_passed=on_chain > 0, sibling_passed=sibling_passed)

    def observe_call(self, k: int, ms: float, live_tokens: int) -> None:
        """A decode call of K took ``ms`` with ``live_tokens`` live tokens (no prompt chunks in it)."""
        if self.prices is not None:
            self.prices.observe(k, ms, live_tokens)

    def observe_acceptance(self, proposed: int, accepted: int, match_len: int = 0) -> None:
        """A row verified ``proposed`` drafts of class ``match_len`` (:attr:`Proposal.dispatch_class`) and
        ``accepted`` of them passed."""
        if proposed:
            self.stats.observe(proposed, accepted, match_len)
