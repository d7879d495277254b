"""Sampling parameters, logits processing and the speculative acceptance rules."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from qspec.runtime.sampling import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    make_rng,
    process_logits,
    sample_token,
)

# Upper 0.1 % points of the chi-square distribution (scipy is not a dependency).
CHI2_CRITICAL_999 = {3: 16.266, 15: 37.697}


def chi_square(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's statistic; infinite if a cell of probability 0 was observed."""
    expected = observed.sum() * expected_probs
    if observed[expected == 0].any():
        return float("inf")
    cells = expected > 0
    return float((((observed - expected) ** 2)[cells] / expected[cells]).sum())


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


def test_sampling_params_defaults_are_greedy():
    """Defaults: greedy, no top-k/top-p, 128 new tokens, no stop strings."""
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0
    assert params.max_new_tokens == 128 and params.stop == [] and not params.ignore_eos
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_new_tokens": 0},
        {"temprature": 1.0},  # extra="forbid" catches typos
    ],
)
def test_sampling_params_rejects_bad_values(bad):
    """Out-of-range values and unknown fields are refused."""
    with pytest.raises(ValidationError):
        SamplingParams(**bad)


def test_sampling_params_frozen():
    """SamplingParams is immutable."""
    with pytest.raises(ValidationError):
        SamplingParams().temperature = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# process_logits
# --------------------------------------------------------------------------------------------


def test_greedy_is_one_hot_argmax_lowest_tie():
    """temperature 0 gives the one-hot of the argmax; ties go to the lowest index."""
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 2.0, 5.0]])
    probs = process_logits(logits, SamplingParams())
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    assert probs.dtype == np.float64


def test_temperature_softmax():
    """Probabilities are softmax(logits / temperature)."""
    logits = np.array([[0.0, np.log(3.0)]])  # softmax: [1/4, 3/4]
    assert np.allclose(process_logits(logits, SamplingParams(temperature=1.0)), [[0.25, 0.75]])
    # temperature 0.5 squares the odds: 1 : 9
    assert np.allclose(process_logits(logits, SamplingParams(temperature=0.5)), [[0.1, 0.9]])


def test_numerically_stable():
    """Huge logits give finite probabilities that sum to 1."""
    logits = np.array([[1e4, 1e4 - 1.0, -1e4], [-1e30, 0.0, 1e30]], dtype=np.float32)
    probs = process_logits(logits, SamplingParams(temperature=0.01))
    assert np.isfinite(probs).all() and np.allclose(probs.sum(axis=-1), 1.0)


def test_top_k_keeps_k_largest():
    """top_k=2 keeps the two largest logits and renormalizes."""
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]]))
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.allclose(probs, [[0, 4 / 7, 0, 3 / 7]])
    # top_k >= vocab is off
    assert np.allclose(process_logits(logits, SamplingParams(temperature=1.0, top_k=9)), np.exp(logits))


def test_top_p_hf_semantics():
    """top_p keeps the smallest set of top tokens reaching top_p, and always the top token."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    keep_two = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert np.allclose(keep_two, [[0.5 / 0.8, 0.3 / 0.8, 0, 0]])  # 0.5 + 0.3 >= 0.75
    keep_three = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.85))
    assert np.allclose(keep_three, [[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]])
    keep_top = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert np.allclose(keep_top, [[1, 0, 0, 0]])


def test_top_k_then_top_p():
    """top-k applies before top-p, as in HF: top-p sees the renormalized top-k distribution."""
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]]))
    # top-2 -> [4/7, 3/7]; top_p 0.5: 4/7 >= 0.5 alone
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert np.allclose(probs, [[1, 0, 0, 0]])


# --------------------------------------------------------------------------------------------
# accept_greedy
# --------------------------------------------------------------------------------------------


def test_accept_greedy_examples():
    """The longest agreeing prefix is accepted; the bonus is the argmax after it."""
    assert accept_greedy(np.array([5, 6, 9, 4]), np.array([5, 6, 7])) == (2, 9)  # emits 5 6 9
    assert accept_greedy(np.array([5, 6, 7, 4]), np.array([5, 6, 7])) == (3, 4)  # emits 5 6 7 4
    assert accept_greedy(np.array([1, 6, 7, 4]), np.array([5, 6, 7])) == (0, 1)  # emits 1
    assert accept_greedy(np.array([3]), np.array([], dtype=np.int64)) == (0, 3)  # no drafts


# --------------------------------------------------------------------------------------------
# accept_sampled
# --------------------------------------------------------------------------------------------


def test_sampled_with_temperature_zero_is_greedy():
    """On one-hot (temperature 0) probabilities, accept_sampled equals accept_greedy."""
    rng = np.random.default_rng(0)
    sample_rng = make_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 5))
        logits = rng.integers(0, 3, size=(n + 1, 6)).astype(np.float32)  # many ties
        drafts = rng.integers(0, 6, size=n)
        probs = process_logits(logits, SamplingParams(temperature=0.0))
        expected = accept_greedy(logits.argmax(axis=-1), drafts)
        assert accept_sampled(probs, drafts, sample_rng) == expected
        assert accept_sampled(probs, drafts, sample_rng, draft_probs=np.full((n, 6), 1 / 6)) == expected


def test_sampled_certain_and_impossible_drafts():
    """p(x) = 1 is always accepted; p(x) = 0 is always rejected and never redrawn."""
    rng = make_rng(1)
    probs = np.array([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])
    for _ in range(200):
        num_accepted, token = accept_sampled(probs, np.array([1, 1]), rng)
        assert num_accepted == 1 and token in (0, 2)  # draft 1 kept, then 1 impossible at row 1


def test_make_rng_reproducible():
    """The same seed gives the same tokens; different seeds differ."""
    probs = np.full(10, 0.1)
    a, b = make_rng(7), make_rng(7)
    assert [sample_token(probs, a) for _ in range(20)] == [sample_token(probs, b) for _ in range(20)]
    assert len({sample_token(probs, make_rng(seed)) for seed in range(50)}) > 1


# --------------------------------------------------------------------------------------------
# Losslessness: speculative sampling emits exactly the target distribution
# --------------------------------------------------------------------------------------------

# Target distribution at each absolute position, independent of context, so the first two
# emitted tokens must be independent draws from TARGET[0] and TARGET[1].
TARGET = np.array(
    [
        [0.1, 0.2, 0.3, 0.4],
        [0.4, 0.1, 0.4, 0.1],
        [0.25, 0.25, 0.25, 0.25],
        [0.7, 0.1, 0.1, 0.1],
    ]
)
FIXED_DRAFTS = [2, 0, 1]  # deterministic proposer: the draft for each position
DRAFT_Q = np.array(  # draft model: distribution of its draft at each position
    [
        [0.4, 0.3, 0.2, 0.1],
        [0.1, 0.6, 0.2, 0.1],
        [0.1, 0.1, 0.1, 0.7],
    ]
)
TRIALS = 10_000


def emit_two(accept, rng, *, draft_model: bool) -> tuple[int, int]:
    """Run speculative steps (2 drafts each) until two tokens are emitted; return them."""
    emitted: list[int] = []
    while len(emitted) < 2:
        pos = len(emitted)
        if draft_model:
            q = DRAFT_Q[pos : pos + 2]
            drafts = np.array([rng.choice(4, p=row) for row in q])
        else:
            q = None
            drafts = np.array(FIXED_DRAFTS[pos : pos + 2])
        num_accepted, token = accept(TARGET[pos : pos + len(drafts) + 1], drafts, rng, q)
        emitted += drafts[:num_accepted].tolist() + [token]
    return emitted[0], emitted[1]


def joint_chi_square(accept, *, draft_model: bool, seed: int = 0) -> float:
    """Chi-square of the first two emitted tokens against TARGET[0] x TARGET[1] (15 dof)."""
    rng = make_rng(seed)
    counts = np.zeros((4, 4))
    for _ in range(TRIALS):
        first, second = emit_two(accept, rng, draft_model=draft_model)
        counts[first, second] += 1
    expected = np.outer(TARGET[0], TARGET[1])
    return chi_square(counts.ravel(), expected.ravel())


def always_accept(probs, drafts, rng, draft_probs=None):
    """WRONG: keeps every draft, then samples the bonus."""
    return len(drafts), sample_token(probs[len(drafts)], rng)


def redraw_without_removing(probs, drafts, rng, draft_probs=None):
    """WRONG: accepts with p(x) but redraws from p itself, x included."""
    for i, x in enumerate(drafts.tolist()):
        if rng.random() >= probs[i][x]:
            return i, sample_token(probs[i], rng)
    return len(drafts), sample_token(probs[len(drafts)], rng)


def draft_model_redraw_from_p(probs, drafts, rng, draft_probs):
    """WRONG: min(1, p/q) acceptance but redraws from p instead of max(0, p - q)."""
    for i, x in enumerate(drafts.tolist()):
        if rng.random() * draft_probs[i][x] >= probs[i][x]:
            return i, sample_token(probs[i], rng)
    return len(drafts), sample_token(probs[len(drafts)], rng)


def test_deterministic_draft_rule_is_lossless():
    """Accept with p(x), else redraw from p without x: the target distribution exactly."""
    assert joint_chi_square(accept_sampled, draft_model=False) < CHI2_CRITICAL_999[15]


def test_draft_model_rule_is_lossless():
    """Accept with min(1, p/q), else redraw from max(0, p - q): the target distribution exactly."""
    assert joint_chi_square(accept_sampled, draft_model=True) < CHI2_CRITICAL_999[15]


@pytest.mark.parametrize(
    ("wrong_rule", "draft_model"),
    [(always_accept, False), (redraw_without_removing, False), (draft_model_redraw_from_p, True)],
)
def test_wrong_rules_fail_the_same_check(wrong_rule, draft_model):
    """The chi-square check has teeth: each wrong rule is rejected."""
    assert joint_chi_square(wrong_rule, draft_model=draft_model) > CHI2_CRITICAL_999[15]


def test_sample_token_matches_distribution():
    """sample_token draws from its (unnormalized) weights and never a zero-weight token."""
    rng = make_rng(3)
    weights = np.array([2.0, 0.0, 1.0, 1.0])  # -> [0.5, 0, 0.25, 0.25]
    counts = np.bincount([sample_token(weights, rng) for _ in range(4000)], minlength=4)
    assert counts[1] == 0
    assert chi_square(counts, weights / weights.sum()) < CHI2_CRITICAL_999[3]
