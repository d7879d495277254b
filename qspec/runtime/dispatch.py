"""Which compiled K a decode step runs.

``cover`` (the default, :func:`pick_k`): the smallest K that covers the batch's longest proposal.

``cost``: the K with the most expected tokens per millisecond, drafts cut to it. With several
sequences in flight one long proposal would otherwise make every row pay for ``seq_len = K + 1``;
on a CPU a batch-4 K=4 call costs about twice a K=0 call. Expected tokens use a running estimate of
``c_i``, the chance that draft ``i`` is accepted given that drafts ``1..i-1`` were::

    tokens(K) = Σ_rows [1 + Σ_{i ≤ min(n_row, K)} c_1 · … · c_i]       rate(K) = tokens(K) / cost(K)

Example: Ks ``[0, 4]``, costs 40 / 80 ms, two rows with 4 and 0 drafts, every ``c_i = 0.5``:
K=0 gives 2 tokens / 40 ms = 0.050; K=4 gives 2 + (0.5 + 0.25 + 0.125 + 0.0625) = 2.94 tokens /
80 ms = 0.037, so K=0 runs and the drafts are dropped. With ``c_i = 0.9`` K=4 gives 5.10 / 80 =
0.064 and wins. Cutting drafts never changes the output, only the speed.

The costs start as the warm-up's calls on padding and then follow the engine's own calls
(:class:`CallCosts`): a padding call skips attention, and three calls at start-up on a noisy machine
once priced batch-4 K=4 low enough that ``pld`` at 4 sequences ran 0.76x ``none``.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from qspec.errors import ConfigError

# auto: cost for greedy steps with several slots or int8/int4 weights, else cover (see Engine)
DISPATCH_MODES = ("auto", "cover", "cost")
# A larger K must promise 10 % more tokens per ms than the best smaller one: the estimate is high for
# Ks that rarely run (pld [0,4] at batch 4 ran 49 K=4 calls on it and landed 0.95x none).
MARGIN = 1.1
# Cost dispatch drops drafts it expects to be rejected, and then learns nothing more about them: after
# this many steps with drafts on offer and none verified, one step verifies one draft a row. (A few
# early rejections once priced pld's drafts out for a whole run: 2 K=4 calls of 508 at batch 4.)
EXPLORE_EVERY = 8
PRIOR_ACCEPTED = 1.0  # a weak prior of c_i = 0.5 until drafts have been verified
PRIOR_TRIED = 2.0


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


def measure_costs(model, ks: Sequence[int], repeats: int) -> dict[int, float]:
    """Median ms of a call of each K's decode specialization on padding; ``repeats=0``: K + 1 (tokens per call)."""
    costs = {}
    for k in ks:
        bound = model.decode[k]
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            model.run(bound)
            times.append((time.perf_counter() - begin) * 1000)
        costs[k] = float(np.median(times)) if times else float(k + 1)
    return costs


def measure_live_costs(model, ks: Sequence[int], repeats: int) -> CallCosts:
    """Prices for a graph whose MatMuls run on live tokens only: each K's call with every row live
    (``K + 1`` tokens a row), and the largest K's with one live token a row, which gives the price of a
    live token. Writes the first slots of every KV row (before any request is in flight)."""

    def median_ms(bound, tokens_per_row: int) -> float:
        bound.fill_live(tokens_per_row)
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            model.run(bound)
            times.append((time.perf_counter() - begin) * 1000)
        bound.reset()
        return float(np.median(times))

    full = {k: median_ms(model.decode[k], k + 1) for k in ks}
    top = ks[-1]
    rows = model.decode[top].spec.batch_size
    per_token = max(0.0, (full[top] - median_ms(model.decode[top], 1)) / (rows * top)) if top else 0.0
    return CallCosts(full, per_token=per_token, measured_tokens={k: rows * (k + 1) for k in ks})


def expected_tokens(lengths: Sequence[int], k: int, chain: np.ndarray) -> float:
    """Tokens a call of K produces in expectation: one per row plus its accepted drafts.

    ``chain[i - 1]`` is the chance that drafts ``1..i`` are all accepted.
    """
    gains = np.concatenate(([0.0], np.cumsum(chain)))
    return float(sum(1.0 + gains[min(n, k, len(chain))] for n in lengths))


def plan_by_cost(
    ks: Sequence[int], price: Callable[[int, int], float], lengths: Sequence[int], chain: np.ndarray
) -> tuple[int, int]:
    """``(K, depth)``: every row verifies its first ``min(n, depth)`` drafts in a call of K (the
    smallest compiled K covering them), the depth with the most expected tokens per ms; a plan of a
    larger K must beat the best one so far by :data:`MARGIN`. ``price(K, live_tokens)``: ms of a call.

    On a graph that pads every row to ``K + 1`` tokens the price depends on K only, and the plans are
    the Ks up to the ``cover`` K. On a graph whose MatMuls run on live tokens only (the runtime
    graph: ``pack_tokens`` or ``trim_rows`` of :func:`qspec.backends.ort_attention.fuse_attention`) a
    row's drafts cost what they are, and a depth between two compiled Ks (rows cut to 2 drafts in a
    K=4 call) can win.
    """
    best, best_rate = (ks[0], 0), -1.0
    for depth in range(pick_k(ks, max(lengths, default=0)) + 1):
        drafts = [min(n, depth, len(chain)) for n in lengths]
        if depth and max(drafts, default=0) < depth:  # no row has that many drafts: nothing deeper
            break
        k = pick_k(ks, max(drafts, default=0))
        rate = expected_tokens(lengths, depth, chain) / price(k, sum(1 + n for n in drafts))
        margin = MARGIN if k > best[0] else 1.0  # a larger K must earn the margin; more drafts in the same K need not
        if rate > best_rate * margin + 1e-12:
            best, best_rate = (k, depth), rate
    return best


def pick_k_by_cost(ks: Sequence[int], costs_ms: Mapping[int, float], lengths: Sequence[int], chain: np.ndarray) -> int:
    """The compiled K with the highest expected tokens per ms at a price per K (:func:`plan_by_cost`),
    at most the ``cover`` K; a larger K must beat the best smaller one by :data:`MARGIN`.

    A K above the one covering the longest proposal adds no token, only padding; its measured cost can
    still come out lower (a noisy warm-up), which once made ``none`` at batch 4 run K=4 on every step.
    """
    return plan_by_cost(ks, lambda k, live: costs_ms[k], lengths, chain)[0]


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


class AcceptanceStats:
    """Running estimate of ``c_i`` per draft position ``i`` (1-based) from verified steps."""

    def __init__(self, k_max: int):
        self.tried = np.full(max(k_max, 1), PRIOR_TRIED)
        self.accepted = np.full(max(k_max, 1), PRIOR_ACCEPTED)

    def observe(self, proposed: int, accepted: int) -> None:
        """Draft ``i`` was tried iff drafts before it were accepted: ``i <= accepted + 1``."""
        tried = min(proposed, accepted + 1)
        self.tried[:tried] += 1
        self.accepted[:accepted] += 1

    def chain(self) -> np.ndarray:
        """``[P(d_1 accepted), P(d_1, d_2 accepted), ...]``."""
        return np.cumprod(self.accepted / self.tried)
