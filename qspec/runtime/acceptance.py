"""What cost dispatch knows about drafts: how often they are accepted, and whether drafting pays at all.

- :class:`AcceptanceStats`: ``c_i`` per draft position for proposals without probabilities of their own,
  per proposal class (prompt lookup: the match length).
- :class:`SurvivalStats`: a draft head's own probabilities (:attr:`Proposal.survival`) calibrated by what
  the target accepted: each draft's chance given the drafts before it passed, per head probability tenth.
- :class:`DraftGate`: per request, whether its drafts save more ms than making them costs (a head's calls),
  else the request drafts nothing for a while.

The rule that uses them, :func:`qspec.runtime.dispatch.plan_by_cost`, is in :mod:`qspec.runtime.dispatch`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np

PRIOR_ACCEPTANCE = 0.5  # c_1 before any draft has been verified ...
PRIOR_WEIGHT = 2.0  # ... worth two observations (see AcceptanceStats)
SURVIVAL_BINS = 10  # SurvivalStats: a draft's probability in tenths ...
SURVIVAL_DEPTHS = 3  # ... at depth 1, 2, and 3 or more


class AcceptanceStats:
    """Running estimates of ``c_i``, the chance that draft ``i`` (1-based) is accepted given that drafts
    ``1..i-1`` were, one set per proposal class (:attr:`Proposal.dispatch_class`): how far a prompt-lookup
    draft gets depends on what it continues (a draft after a 3-gram match is accepted far more often
    than one after a 1-gram match), a head's draft on how sure the head was.

    A class's ``c_1`` starts from every class's pooled ``c_1`` (itself from 0.5), and a deeper ``c_i``
    from the class's own ``c_{i-1}``, each worth :data:`PRIOR_WEIGHT` observations: a class seen a few
    times borrows from the others, and drafts never verified yet are priced like the shallower ones
    (with a flat prior, rows cut to one draft never learned whether a second one pays).
    """

    def __init__(self, k_max: int):
        self.k_max = max(k_max, 1)
        self._by_class: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # match_len -> (tried, accepted)
        self._pooled = self._zeros()  # (tried, accepted) of every class
        self._chains: dict[int, np.ndarray] = {}

    def _zeros(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(self.k_max), np.zeros(self.k_max)

    def observe(self, proposed: int, accepted: int, match_len: int = 0) -> None:
        """Draft ``i`` was tried iff drafts before it were accepted: ``i <= accepted + 1``."""
        tried = min(proposed, accepted + 1, self.k_max)
        accepted = min(accepted, self.k_max)
        for counts in (self._counts(match_len), self._pooled):
            counts[0][:tried] += 1
            counts[1][:accepted] += 1
        self._chains.clear()

    def counts(self, match_len: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(tried, accepted)`` per draft position for one class (observations only, no prior)."""
        tried, accepted = self._counts(match_len)
        return tried.copy(), accepted.copy()

    def _counts(self, match_len: int) -> tuple[np.ndarray, np.ndarray]:
        if match_len not in self._by_class:
            self._by_class[match_len] = self._zeros()
        return self._by_class[match_len]

    def chain(self, match_len: int = 0) -> np.ndarray:
        """``[P(d_1 accepted), P(d_1, d_2 accepted), ...]`` for a proposal of this class."""
        chain = self._chains.get(match_len)
        if chain is None:
            pooled_tried, pooled_accepted = self._pooled
            first = (pooled_accepted[0] + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (pooled_tried[0] + PRIOR_WEIGHT)
            tried, accepted = self._counts(match_len)
            rates, prior = [], first
            for i in range(self.k_max):
                prior = (accepted[i] + PRIOR_WEIGHT * prior) / (tried[i] + PRIOR_WEIGHT)
                rates.append(prior)
            chain = self._chains[match_len] = np.cumprod(rates)
        return chain


class SurvivalStats:
    """A draft head's probabilities, calibrated: the chance that a draft is accepted given the drafts before it
    were, per bin of (depth, the head's probability of it in tenths), each bin starting from the head's own
    probability worth :data:`PRIOR_WEIGHT` observations.

    A row's survival (vLLM's name: the chance that drafts ``1..i`` all pass) is the product of its drafts'
    calibrated rates. Example: drafts at head probabilities ``[0.95, 0.6]`` before any verification give
    ``[0.95, 0.57]``; once 20 first drafts at 0.9-1.0 were verified and 10 accepted, the first draft's rate is
    ``(10 + 2 * 0.95) / (20 + 2) = 0.54``, and the row's survival ``[0.54, 0.32]``.
    """

    def __init__(self) -> None:
        self.tried = np.zeros((SURVIVAL_DEPTHS, SURVIVAL_BINS))
        self.accepted = np.zeros((SURVIVAL_DEPTHS, SURVIVAL_BINS))

    @staticmethod
    def bins(survival: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(depth index, tenth, conditional probability)`` of each draft of a survival ``[n]``."""
        survival = np.asarray(survival, np.float64)
        previous = np.concatenate([[1.0], survival[:-1]])
        conditional = np.clip(survival / np.maximum(previous, 1e-12), 0.0, 1.0)
        depth = np.minimum(np.arange(len(survival)), SURVIVAL_DEPTHS - 1)
        tenth = np.minimum((conditional * SURVIVAL_BINS).astype(np.int64), SURVIVAL_BINS - 1)
        return depth, tenth, conditional

    def chain(self, survival: np.ndarray) -> np.ndarray:
        """The calibrated survival of a row's drafts: ``[P(d_1 passes), P(d_1, d_2 pass), ...]``."""
        depth, tenth, conditional = self.bins(survival)
        tried, accepted = self.tried[depth, tenth], self.accepted[depth, tenth]
        return np.cumprod((accepted + PRIOR_WEIGHT * conditional) / (tried + PRIOR_WEIGHT))

    def observe(self, survival: np.ndarray, accepted: int) -> None:
        """A row verified the drafts of ``survival`` and ``accepted`` passed: drafts ``1..accepted + 1`` were tried."""
        depth, tenth, _ = self.bins(survival)
        tried = min(len(depth), accepted + 1)
        np.add.at(self.tried, (depth[:tried], tenth[:tried]), 1)
        np.add.at(self.accepted, (depth[:accepted], tenth[:accepted]), 1)


SIBLING_PRIOR = 0.2  # SiblingStats: a sibling's chance to pass when the first draft fails, before any was tried


class SiblingStats:
    """A tree's drafts off the chain (siblings of the first draft, :class:`~qspec.runtime.layout.VerifyLayout`):
    how often one passes when it is tried, that is when the first draft of the chain fails (the target's token
    after ``last`` is not the chain's). ``rate`` starts from :data:`SIBLING_PRIOR` (or a head's own probability
    of the sibling) worth :data:`PRIOR_WEIGHT` observations. Example: 10 tried, 3 passed: ``(3 + 2 * 0.2) / 12
    = 0.28``; with a first draft at survival 0.6 a sibling adds ``0.4 * 0.28 = 0.11`` expected tokens.
    """

    def __init__(self) -> None:
        self.tried = 0  # rows whose first draft failed with siblings on offer
        self.passed = 0  # ... and one of them was the target's token
        self.offered = 0  # rows verified with siblings

    def rate(self, prior: float = SIBLING_PRIOR) -> float:
        return (self.passed + PRIOR_WEIGHT * prior) / (self.tried + PRIOR_WEIGHT)

    def gains(self, n: int, first: float, head: np.ndarray | None = None) -> np.ndarray:
        """Expected tokens each of ``n`` siblings adds beside a first draft of survival ``first`` (``head``: the
        drafter's own probability of each, as the prior)."""
        priors = np.full(n, SIBLING_PRIOR) if head is None else np.asarray(head, np.float64)
        return np.array([(1.0 - first) * self.rate(float(prior)) for prior in priors])

    def observe(self, n: int, *, first_passed: bool, sibling_passed: bool) -> None:
        """A row verified ``n`` siblings beside its chain."""
        self.offered += 1
        if not first_passed:
            self.tried += 1
            self.passed += int(sibling_passed)


GATE_DECAY = 0.2  # DraftGate: weight of the newest step in each running mean
GATE_PAUSE = 4  # steps a request drafts nothing after its drafting stopped paying ...
GATE_MAX_PAUSE = 64  # ... doubling, up to this, each time a trial step finds it still does not


class DraftGate:
    """Per request, whether its drafting pays: the ms its accepted drafts save against the ms its drafting costs.

    A step saves ``accepted * ms_per_token`` (a token of a call without drafts) and costs the request's share of
    the step's drafting time (``propose_ms / rows drafting``) plus ``per_token`` ms for each draft verified.
    Running means of both per request (the cost's drafting share across requests); a request whose drafting
    saves less than it costs drafts nothing for :data:`GATE_PAUSE` steps, then drafts one step to measure again
    (the pause doubles while it still does not pay, and halves on a step that pays). Example: a head costing
    1.2 ms a step for each row, 0.3 ms a verified draft, 2 ms a token: a row accepting 0.5 of its 1.0 verified
    drafts a step saves 1.0 ms for 1.5: it stops; one accepting 0.9 saves 1.8: it drafts on. Prompt lookup costs
    microseconds: it always pays.
    """

    def __init__(self) -> None:
        self.share_ms = 0.0  # running mean of a drafting row's share of the drafting time
        self._rows: dict[Hashable, list[float]] = {}  # request -> [accepted, verified, paused steps, pause]
        self.trials: list[bool] = []  # of the last open(): which keys draft on a trial step

    def open(self, keys: Iterable[Hashable], *, ms_per_token: float, per_token: float) -> list[bool]:
        """Which of ``keys`` draft this step (a paused request counts a step down)."""
        out, self.trials = [], []
        for key in keys:
            row = self._rows.setdefault(key, [1.0, 1.0, 0.0, float(GATE_PAUSE)])  # a new request drafts
            self.trials.append(row[2] == 1)
            if row[2] > 0:
                row[2] -= 1
                out.append(row[2] == 0)  # the last paused step is a trial
                continue
            pays = row[0] * ms_per_token >= self.share_ms + row[1] * per_token
            if not pays:
                row[2], row[3] = row[3], min(row[3] * 2, GATE_MAX_PAUSE)
            else:  # halved, not reset: one lucky trial must not bring back a drafting that pays on the whole less
                row[3] = max(row[3] / 2, GATE_PAUSE)
            out.append(pays)
        return out

    def observe_drafting(self, ms: float, rows: int) -> None:
        """A step's drafting took ``ms`` for ``rows`` requests that drafted."""
        if rows:
            self.share_ms += GATE_DECAY * (ms / rows - self.share_ms)

    def observe(self, key: Hashable, verified: int, accepted: int) -> None:
        """A request that drafted this step verified ``verified`` drafts and ``accepted`` of them passed."""
        row = self._rows.setdefault(key, [1.0, 1.0, 0.0, float(GATE_PAUSE)])
        row[0] += GATE_DECAY * (accepted - row[0])
        row[1] += GATE_DECAY * (verified - row[1])

    def __len__(self) -> int:
        return len(self._rows)

    def forget(self, keep: Iterable[Hashable]) -> None:
        """Drop every request but ``keep``."""
        keep = set(keep)
        for key in [k for k in self._rows if k not in keep]:
            del self._rows[key]
