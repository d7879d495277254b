"""Cost-based dispatch: expected tokens per ms decide K, with hand-made costs and acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from qspec.runtime.acceptance import GATE_PAUSE, DraftGate, SurvivalStats
from qspec.runtime.dispatch import (
    EXPLORE_EVERY,
    AcceptanceStats,
    CallCosts,
    Dispatcher,
    expected_tokens,
    pick_k_by_cost,
)
from qspec.runtime.proposal import Proposal
from qspec.runtime.proposers import PromptLookupProposer

COSTS = {0: 40.0, 4: 80.0}
PROMPTS = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [20, 21] * 5, [30, 31, 32, 33, 34] * 2]


@pytest.fixture(scope="module")
def four_slots(tiny_model, tmp_path_factory):
    """A tiny llama package with K in {0, 4} and 4 KV slots (its runtime graph runs live tokens only)."""
    from qspec.compile import CompileOptions, compile_package
    from qspec.specializations import make_config

    config = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=64, full_batch_size=4)
    folder = tmp_path_factory.mktemp("four-slots") / "pkg"
    return compile_package(tiny_model("llama"), CompileOptions(specialization=config), output=folder)[0]


def greedy_none(package, params) -> list[list[int]]:
    """`none`'s greedy tokens for PROMPTS: what every speculative run must give."""
    from qspec.runtime import Engine

    return [out.token_ids for out in Engine(package, method="none").generate(PROMPTS, params)]


def test_expected_tokens_counts_one_per_row_plus_accepted_chain():
    """Two rows verifying 4 and 0 drafts, c_i = 0.5: 2 + 0.5 + 0.25 + 0.125 + 0.0625."""
    chain = np.cumprod([0.5] * 4)
    assert expected_tokens([4, 0], [chain, chain]) == 2.9375
    assert expected_tokens([0, 0], [chain, chain]) == 2.0
    assert expected_tokens([1, 1], [chain, chain]) == 3.0  # each row cut to one draft: 2 + 0.5 + 0.5
    assert expected_tokens([2, 1], [chain, np.cumprod([0.9] * 4)]) == 3.65  # rows of their own: 2 + 0.75 + 0.9


def test_low_acceptance_drops_the_drafts():
    """At c_i = 0.5 a call twice as expensive does not pay: K=0 runs."""
    assert pick_k_by_cost([0, 4], COSTS, [4, 0], np.cumprod([0.5] * 4)) == 0


def test_high_acceptance_runs_the_long_call():
    """At c_i = 0.9 the K=4 call gives 5.1 tokens for 80 ms and wins."""
    assert pick_k_by_cost([0, 4], COSTS, [4, 0], np.cumprod([0.9] * 4)) == 4


def test_nothing_proposed_runs_the_cheapest_call():
    """No drafts: every K gives one token per row, so the cheapest K runs."""
    assert pick_k_by_cost([0, 1, 4], {0: 25.0, 1: 27.0, 4: 30.0}, [0, 0], np.cumprod([0.9] * 4)) == 0


def test_never_a_k_above_the_one_covering_the_longest_proposal():
    """A noisy warm-up can measure K=4 below K=0; with no drafts K=0 still runs, with 1 draft K=1 at most."""
    noisy = {0: 50.0, 1: 48.0, 4: 40.0}
    assert pick_k_by_cost([0, 1, 4], noisy, [0, 0, 0, 0], np.cumprod([0.9] * 4)) == 0
    assert pick_k_by_cost([0, 1, 4], noisy, [1, 0, 0, 0], np.cumprod([0.9] * 4)) == 1
    assert pick_k_by_cost([0, 1, 4], noisy, [3, 0], np.cumprod([0.9] * 4)) == 4


def proposals(*lengths: int, match_len: int = 0) -> list[Proposal]:
    """One proposal a row, with ``lengths[r]`` drafts of class ``match_len``."""
    return [Proposal(np.arange(7, 7 + n), match_len=match_len) for n in lengths]


def test_none_plans_the_smallest_k_whatever_the_prices():
    """`none` (k_max 0) at 4 rows runs the smallest K even if a noisy warm-up priced K=4 cheaper."""
    dispatcher = Dispatcher([0, 4], mode="auto", k_max=0, prices=CallCosts({0: 50.0, 4: 10.0}))
    assert dispatcher.plan(proposals(0, 0, 0, 0), greedy=True) == (0, [0, 0, 0, 0])


def test_none_at_batch_4_runs_only_k0(four_slots):
    """method none with auto dispatch at 4 slots: every decode call is the smallest K."""
    from qspec.runtime import Engine, SamplingParams

    engine = Engine(four_slots, method="none")
    engine.generate(["abc", "def", "ghi", "jkl"], SamplingParams(max_new_tokens=6, ignore_eos=True))
    calls = engine.last_metrics.calls
    assert calls["4"] == 0 and calls["0"] > 0


def test_modes_plan_cover_or_cost():
    """cover runs the K covering the longest proposal; cost drops drafts that do not pay (c_1 = 0.5 prior,
    K=4 twice K=0's price); auto is cost for greedy steps and cover when one samples."""
    prices = CallCosts({0: 40.0, 4: 80.0})
    offer = proposals(4, 0)
    assert Dispatcher([0, 4], mode="cover").plan(offer, greedy=True) == (4, [4, 0])
    assert Dispatcher([0, 4], mode="cost", prices=prices).plan(offer, greedy=True) == (0, [0, 0])
    auto = Dispatcher([0, 4], mode="auto", prices=prices)
    assert auto.step_mode(greedy=True) == "cost" and auto.step_mode(greedy=False) == "cover"
    assert auto.plan(offer, greedy=False) == (4, [4, 0])


def test_cost_mode_needs_prices_and_modes_are_checked():
    """cost without prices and an unknown mode are configuration errors naming the fix."""
    from qspec.errors import ConfigError

    with pytest.raises(ConfigError, match="needs the prices"):
        Dispatcher([0, 4], mode="cost")
    with pytest.raises(ConfigError, match="dispatch 'fast': use auto, cover, cost"):
        Dispatcher([0, 4], mode="fast")


def test_acceptance_stats_count_only_tried_drafts():
    """Draft i is tried only when drafts before it were accepted."""
    stats = AcceptanceStats(4)
    stats.observe(proposed=4, accepted=1)  # d1 accepted, d2 rejected, d3 d4 never tried
    tried, accepted = stats.counts()
    assert tried.tolist() == [1, 1, 0, 0]
    assert accepted.tolist() == [1, 0, 0, 0]
    # pooled c_1 = (1 accepted + 2 x 0.5) / (1 tried + 2) = 2/3, the class's prior: (1 + 2 x 2/3) / (1 + 2)
    assert stats.chain()[0] == (1 + 2 * 2 / 3) / 3


def test_acceptance_stats_keep_one_estimate_per_match_length():
    """Drafts after 3-gram matches always pass and after 1-gram matches never do: each class learns its
    own chain; a class never seen starts from the pooled first-draft rate, and deeper drafts never tried
    start from the class's shallower ones (not from a flat 0.5)."""
    stats = AcceptanceStats(4)
    for _ in range(20):
        stats.observe(proposed=4, accepted=4, match_len=3)
        stats.observe(proposed=4, accepted=0, match_len=1)
    strong, weak, unseen = stats.chain(3), stats.chain(1), stats.chain(2)
    assert strong[3] > 0.8 and weak[0] < 0.1
    assert unseen[0] == (20 + 2 * 0.5) / (40 + 2)  # pooled c_1: 20 of 40 first drafts, and the prior
    assert np.allclose(unseen, np.cumprod([unseen[0]] * 4))
    stats.observe(proposed=2, accepted=2, match_len=2)  # two drafts, both passed; the third never tried
    c = stats.chain(2) / np.concatenate(([1.0], stats.chain(2)[:-1]))  # c_i from the chain
    assert c[2] == c[1] and c[1] > unseen[0]


def test_call_costs_follow_the_calls_not_one_outlier():
    """The price is the median of the recent calls, the warm-up's measurement the first of them."""
    costs = CallCosts({0: 10.0, 4: 1.0}, window=5)
    for ms in (30.0, 31.0, 500.0, 29.0):  # one outlier among the real calls
        costs.observe(4, ms)
    assert costs[4] == 30.0 and costs[0] == 10.0 and dict(costs) == {0: 10.0, 4: 30.0}


def test_observed_calls_teach_a_price_set_too_low():
    """A K=4 priced at almost nothing runs while it looks free; the calls observed teach its real price."""
    dispatcher = Dispatcher([0, 4], mode="cost", prices=CallCosts({0: 10.0, 4: 1e-6}))
    assert dispatcher.plan(proposals(4, 4), greedy=True)[0] == 4
    for _ in range(5):
        dispatcher.observe_call(4, 30.0, live_tokens=10)
    assert dispatcher.prices[4] == 30.0
    assert dispatcher.plan(proposals(4, 4), greedy=True) == (0, [0, 0])


def test_cost_dispatch_learns_a_k_priced_too_low(four_slots):
    """pld at 4 slots whose dispatcher priced K=4 at almost nothing: its calls teach the real price, so
    K=4 stops looking free, and the output is `none`'s."""
    from qspec.runtime import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = greedy_none(four_slots, params)
    engine = Engine(four_slots, method="pld")
    measured = engine.dispatcher.prices
    engine.dispatcher = Dispatcher(engine.ks, mode="auto", prices=CallCosts({0: measured[0], 4: 1e-6}))
    assert [out.token_ids for out in engine.generate(PROMPTS, params)] == plain
    assert engine.last_metrics.calls["4"] > 0  # it ran K=4 while it looked free ...
    assert engine.dispatcher.prices[4] > 1e-3  # ... and learned what a call costs


def test_a_larger_k_must_beat_the_smaller_by_the_margin():
    """K=4 promising 5 % more tokens per ms than K=0 does not run; 20 % more does."""
    from qspec.runtime.dispatch import MARGIN

    chain = np.cumprod([0.5] * 4)  # one drafting row of four: 1 + 0.9375 expected tokens, the other 1
    tokens4 = expected_tokens([4, 0], [chain, chain])
    for gain, k in ((1.05, 0), (1.2, 4)):
        costs = {0: 10.0, 4: 10.0 * tokens4 / 2 / gain}  # K=4's rate = gain x K=0's 2 tokens / 10 ms
        assert pick_k_by_cost([0, 4], costs, [4, 0], chain) == k
    assert 1.05 < MARGIN < 1.2


def live_price(k: int, live_tokens: int) -> float:
    """A graph whose MatMuls run on live tokens only: 16 ms a call plus 1.4 ms a live token."""
    return 16.0 + 1.4 * live_tokens


def test_drafts_priced_by_live_tokens_pay_where_padded_rows_do_not():
    """One row of four drafting at c_i = 0.8: on a graph that pads every row to K + 1 tokens the K=4
    call costs 20 tokens and K=0 runs; when only live tokens cost, drafts cost what they are and K=4 runs
    all 4 (the 4th adds 1 % more tokens per ms: within the same K a plan needs no margin)."""
    from qspec.runtime.dispatch import plan_by_cost

    chain = np.cumprod([0.8] * 4)
    padded = {k: live_price(k, 4 * (k + 1)) for k in (0, 4)}
    assert pick_k_by_cost([0, 4], padded, [4, 0, 0, 0], chain) == 0
    assert plan_by_cost([0, 4], live_price, [4, 0, 0, 0], [chain] * 4) == (4, [4, 0, 0, 0])


def test_rows_cut_to_the_depth_that_pays_inside_a_larger_k():
    """Two rows with 8 drafts whose third is rarely accepted: both verify 2 drafts in the K=8 call
    (7.42 tokens / 27.2 ms beats 1 draft's 5.8 / 24.4 by the margin, 3 drafts' 7.91 / 30.0 does not)."""
    from qspec.runtime.dispatch import plan_by_cost

    chains = [np.cumprod([0.9, 0.9, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1])] * 4
    assert plan_by_cost([0, 8], live_price, [8, 8, 0, 0], chains) == (8, [2, 2, 0, 0])
    assert plan_by_cost([0, 8], lambda k, live: 40.0 if k else 21.6, [8, 8, 0, 0], chains) == (0, [0, 0, 0, 0])


def test_each_row_verifies_the_drafts_its_own_chain_pays_for():
    """The docstring's example: a live token costs 1 ms on a 10 ms call; the row whose drafts are
    likely (chain 0.9, 0.72, ...) verifies two, the unlikely one (0.3, 0.03, ...) one: 4.0 tokens / 15 ms
    beats 3.7 / 14 (the first row alone) and 4.2 / 16 (its third draft too)."""
    from qspec.runtime.dispatch import plan_by_cost

    likely, unlikely = np.array([0.9, 0.8, 0.2, 0.1]), np.array([0.3, 0.1, 0.05, 0.01])
    assert plan_by_cost([0, 4], lambda k, live: 10.0 + live, [4, 4], [likely, unlikely]) == (4, [2, 1])
    # On a graph that pads, drafts inside the K are free: both rows verify all four.
    assert plan_by_cost([0, 4], lambda k, live: 12.0 if k == 0 else 18.0, [4, 4], [likely, unlikely]) == (4, [4, 4])


def test_rows_with_certain_drafts_go_deep_while_others_stay_shallow():
    """Ks [0, 1, 2, 4, 8] at 4 rows: one row continuing a long match (c_i = 0.95) verifies all 8 drafts
    in the K=8 call, the three others (c_i = 0.2) none; the call is priced by its 12 live tokens."""
    from qspec.runtime.dispatch import plan_by_cost

    strong, weak = np.cumprod([0.95] * 8), np.cumprod([0.2] * 8)
    plan = plan_by_cost([0, 1, 2, 4, 8], live_price, [8, 8, 8, 8], [strong, weak, weak, weak])
    assert plan == (8, [8, 0, 0, 0])


def test_call_costs_price_live_tokens():
    """With a price per live token, each call's remainder is what the median follows."""
    costs = CallCosts({0: 21.6, 4: 44.0}, per_token=1.4, measured_tokens={0: 4, 4: 20})
    assert costs.price(4, 20) == 44.0 and round(costs.price(4, 8), 6) == 27.2
    for live in (5, 6, 7, 8):
        costs.observe(4, 20.0 + 1.4 * live, live)  # the calls cost 4 ms less than the warm-up said
    assert round(costs.price(4, 8), 6) == 31.2 and round(costs.price(0, 4), 6) == 21.6


class FixedCosts(CallCosts):
    """Prices that calls do not move (a tiny model's ~1 ms calls are noise)."""

    def observe(self, k: int, ms: float, live_tokens: int = 0) -> None:
        pass


def rejecting_dispatcher(ks: list[int], prices: CallCosts) -> Dispatcher:
    """A cost dispatcher that has seen every draft so far, after any n-gram match, rejected."""
    dispatcher = Dispatcher(ks, mode="cost", prices=prices)
    for match_len in range(4):
        for _ in range(2000):
            dispatcher.observe_acceptance(proposed=4, accepted=0, match_len=match_len)
    return dispatcher


def test_every_explore_every_plans_one_plan_verifies_one_draft_a_row():
    """Drafts priced out EXPLORE_EVERY - 1 times in a row: the next plan verifies one draft a row."""
    dispatcher = rejecting_dispatcher([0, 1, 4], FixedCosts({0: 10.0, 1: 20.0, 4: 30.0}))
    plans = [dispatcher.plan(proposals(4, 2, 0), greedy=True) for _ in range(EXPLORE_EVERY)]
    assert plans[:-1] == [(0, [0, 0, 0])] * (EXPLORE_EVERY - 1)
    assert plans[-1] == (1, [1, 1, 0])


def test_cost_dispatch_keeps_verifying_drafts_it_priced_out(four_slots):
    """pld at 4 slots whose acceptance estimate says drafts never pass: every EXPLORE_EVERY steps with
    drafts on offer one step verifies one draft a row, so the estimate can recover; output is `none`'s."""
    from qspec.runtime import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = greedy_none(four_slots, params)
    engine = Engine(four_slots, method="pld")
    assert engine.model.packs_live_tokens  # a continuous-batching runtime graph prices live tokens
    engine.dispatcher = rejecting_dispatcher(engine.ks, FixedCosts({0: 10.0, 4: 30.0}))  # K=4 never pays
    assert [out.token_ids for out in engine.generate(PROMPTS, params)] == plain
    metrics = engine.last_metrics
    assert 0 < metrics.calls["4"] <= metrics.calls["0"] // (EXPLORE_EVERY - 1) + 1


def test_each_row_goes_as_deep_as_its_match_class_pays():
    """A dispatcher that has seen 3-gram drafts pass and 1-gram drafts fail plans one call where the
    row continuing a 3-gram match verifies all 4 drafts and the rows continuing 1-gram matches none; a
    row of an unseen class borrows the pooled first-draft rate (0.5 here): its first draft pays at a
    20 ms call plus 1 ms a live token (0.5 tokens for 1 ms against ~0.28 a ms), its second does not."""
    prices = CallCosts({0: 24.0, 4: 24.0}, per_token=1.0, measured_tokens={0: 4, 4: 4})  # 20 ms + 1 a token
    dispatcher = Dispatcher([0, 4], mode="cost", prices=prices)
    for _ in range(50):
        dispatcher.observe_acceptance(proposed=4, accepted=4, match_len=3)
        dispatcher.observe_acceptance(proposed=4, accepted=0, match_len=1)
    offer = [Proposal(np.array([7, 8, 9, 10]), match_len=m) for m in (3, 1, 1, 2)]
    assert dispatcher.plan(offer, greedy=True) == (4, [4, 0, 0, 1])


def test_a_heads_sure_drafts_are_verified_and_its_guesses_dropped():
    """Head drafts carry their first draft's probability: a dispatcher that has seen the head's drafts at
    0.9 pass and at 0.1 fail verifies the sure row's draft and drops the unsure one's in the same call;
    lookup's match-length classes are apart from them."""
    prices = CallCosts({0: 24.0, 4: 24.0}, per_token=1.0, measured_tokens={0: 4, 4: 4})
    dispatcher = Dispatcher([0, 4], mode="cost", prices=prices)
    sure, unsure = Proposal(np.array([7]), confidence=0.93), Proposal(np.array([7]), confidence=0.12)
    assert (sure.dispatch_class, unsure.dispatch_class, Proposal(np.array([7]), match_len=2).dispatch_class) == (
        -10,
        -2,
        2,
    )
    for _ in range(50):
        dispatcher.observe_acceptance(proposed=1, accepted=1, match_len=sure.dispatch_class)
        dispatcher.observe_acceptance(proposed=1, accepted=0, match_len=unsure.dispatch_class)
    assert dispatcher.plan([sure, unsure], greedy=True) == (4, [1, 0])
    assert dispatcher.stats.counts(0)[0].sum() == 0  # lookup's classes saw nothing


def test_a_head_asks_how_deep_its_chain_would_be_verified():
    """``useful_depth``: what a cost step would verify of a row's drafts alone. A class whose second drafts fail
    stops at one draft (the head then makes no chained call for a second); a class whose drafts pass goes as deep
    as the cap; a covering step (a sampled row under ``auto``) takes them all."""
    prices = CallCosts({0: 24.0, 1: 24.0, 2: 30.0, 4: 36.0}, per_token=1.0, measured_tokens={0: 1, 1: 2, 2: 3, 4: 5})
    dispatcher = Dispatcher([0, 1, 2, 4], mode="auto", prices=prices)
    for _ in range(50):
        dispatcher.observe_acceptance(proposed=4, accepted=1, match_len=-8)  # first draft passes, the next fails
        dispatcher.observe_acceptance(proposed=4, accepted=4, match_len=-10)
    unsure, sure = Proposal(np.array([7]), confidence=0.75), Proposal(np.array([7]), confidence=0.95)
    assert dispatcher.useful_depth(unsure, 4) == 1
    assert dispatcher.useful_depth(sure, 4) == 4 and dispatcher.useful_depth(sure, 2) == 2
    assert dispatcher.useful_depth(unsure, 4, greedy=False) == 4  # auto covers a sampled row's drafts
    assert Dispatcher([0, 4], mode="cover").useful_depth(unsure, 3) == 3
    assert dispatcher.useful_depth(unsure, 0) == 0


def test_survival_stats_calibrate_a_heads_probabilities():
    """The docstring's example: before any verification a row's survival is the head's own ([0.95, 0.57]);
    after 20 first drafts at 0.9-1.0 of which 10 passed, the first draft's rate is (10 + 2 * 0.95) / 22."""
    stats = SurvivalStats()
    assert np.allclose(stats.chain(np.array([0.95, 0.57])), [0.95, 0.57])
    for accepted in (1, 0) * 10:
        stats.observe(np.array([0.95]), accepted)
    first = (10 + 2 * 0.95) / 22
    assert np.allclose(stats.chain(np.array([0.95, 0.57])), [first, first * 0.6])
    stats.observe(np.array([0.95, 0.57, 0.3]), accepted=1)  # drafts 1 and 2 tried, the third never was
    assert stats.tried[1, 6] == 1 and stats.accepted[1, 6] == 0 and stats.tried[2].sum() == 0


def test_rows_are_priced_by_their_heads_survival():
    """One budget across rows: a head row whose chain the head is sure of verifies all its drafts, one whose
    second draft is a guess verifies its first only, one whose first is a guess none (20 ms a call + 1 ms a
    live token)."""
    prices = CallCosts({0: 24.0, 4: 24.0}, per_token=1.0, measured_tokens={0: 4, 4: 4})
    dispatcher = Dispatcher([0, 4], mode="cost", prices=prices)
    sure = Proposal(np.array([1, 2, 3]), survival=np.array([0.95, 0.9, 0.86]))
    half = Proposal(np.array([1, 2, 3]), survival=np.array([0.9, 0.09, 0.05]))
    guess = Proposal(np.array([1, 2]), survival=np.array([0.08, 0.01]))
    assert dispatcher.plan([sure, half, guess, Proposal.empty()], greedy=True) == (4, [3, 1, 0, 0])
    assert 0.1 < dispatcher.rate < 0.4  # (4 + 0.95 + 0.9 + 0.86 + 0.9) tokens / (20 + 8) ms


def test_a_chain_stops_when_its_next_draft_cannot_pay_for_its_head_call():
    """The docstring's example of ``useful_depth``: last plan 0.2 tokens / ms, a live token 1 ms, a head call
    0.5 ms: after a first draft at 0.5 the second (expected at 0.25) is not made; were head calls free it
    would be; after a first draft at 0.67 it is (a 20 ms call: the row alone would take them all)."""
    prices = CallCosts({0: 21.0, 4: 21.0}, per_token=1.0, measured_tokens={0: 1, 4: 1})
    dispatcher = Dispatcher([0, 4], mode="cost", prices=prices)
    dispatcher.rate = 0.2
    half = Proposal(np.array([7]), survival=np.array([0.5]))
    assert dispatcher.useful_depth(half, 4, draft_ms=0.5) == 1
    assert dispatcher.useful_depth(half, 4, draft_ms=0.0) >= 2
    assert dispatcher.useful_depth(Proposal(np.array([7]), survival=np.array([0.67])), 4, draft_ms=0.5) >= 2


def test_draft_gate_pauses_a_request_whose_drafts_do_not_pay():
    """The docstring's example: drafting costs 1.2 ms a row, a verified draft 0.3 ms, a token 2 ms. A request
    accepting about half its one verified draft a step stops drafting (GATE_PAUSE steps, the last a trial),
    one accepting all of it drafts on; drafting that costs microseconds (lookup) always pays."""
    gate = DraftGate()
    for step in range(40):
        gate.observe_drafting(2.4, 2)
        gate.observe("half", verified=1, accepted=step % 2)
        gate.observe("full", verified=1, accepted=1)
    assert abs(gate.share_ms - 1.2) < 0.01
    opened = [gate.open(["half", "full"], ms_per_token=2.0, per_token=0.3) for _ in range(GATE_PAUSE + 1)]
    assert [row[0] for row in opened] == [False] * GATE_PAUSE + [True]
    assert all(row[1] for row in opened)
    cheap = DraftGate()
    cheap.observe_drafting(0.02, 4)
    cheap.observe("lookup", verified=2, accepted=0)
    assert cheap.open(["lookup", "new"], ms_per_token=2.0, per_token=0.3) == [True, True]


def test_draft_gate_halves_a_pause_on_a_step_that_pays_instead_of_forgetting_it():
    """A request whose drafts never pass is paused 4, 8, 16, 32, 64 steps (each pause ending in a trial); when
    its drafts then pay for a while it drafts on, and when they stop paying it pauses 32 steps (the back-off
    halved), not 4: a lucky trial does not reset the back-off."""
    gate = DraftGate()
    gate.share_ms = 1.2

    def step() -> bool:
        return gate.open(["r"], ms_per_token=2.0, per_token=0.3)[0]

    opens = []
    for _ in range(200):
        opens.append(step())
        gate.observe("r", verified=1, accepted=0)
    pauses = [len(run) for run in "".join("x" if o else "." for o in opens).split("x")[1:-1] if run]
    assert pauses[:5] == [4, 8, 16, 32, 64] and set(pauses[5:]) == {64}
    for _ in range(10):
        gate.observe("r", verified=1, accepted=1)
    while not step():  # the rest of the pause: its trial
        pass
    assert step()  # it pays now
    for _ in range(10):
        gate.observe("r", verified=1, accepted=0)
    paused = [step() for _ in range(33)]
    assert paused == [False] * 32 + [True]


def test_drafting_that_cannot_pay_is_turned_off_and_output_stays_none(four_slots):
    """pld at 4 slots whose drafting looks far too dear for what it saves: the rows draft only on trial steps
    (every GATE_PAUSE steps, then less often), and the output is `none`'s."""
    from qspec.runtime import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = greedy_none(four_slots, params)
    engine = Engine(four_slots, method="pld")
    engine.dispatcher = Dispatcher(engine.ks, mode="auto", prices=FixedCosts({0: 10.0, 4: 30.0}))
    engine.dispatcher.gate.share_ms = 1e9  # a drafting step seen to cost a lifetime
    assert [out.token_ids for out in engine.generate(PROMPTS, params)] == plain
    steps = engine.last_metrics.calls["0"] + engine.last_metrics.calls["4"]
    assert engine.last_metrics.proposed <= 4 * 4 * (steps // GATE_PAUSE + 1)


class SurvivalLookup(PromptLookupProposer):
    """Prompt lookup whose drafts carry a falling survival, as a head's do: cost dispatch prices them by it."""

    def proposal(self, request_id, k: int) -> Proposal:
        base = super().proposal(request_id, k)
        return Proposal(base.tokens, survival=0.8 ** np.arange(1, len(base) + 1)) if len(base) else base


@pytest.mark.parametrize("weight_format", ["fp32", "int4"])
def test_rows_priced_by_survival_give_none_at_one_and_four_slots(tiny_model, tmp_path_factory, weight_format):
    """Drafts with a survival, cost dispatch (each row its own depth, one budget, the gate) at 4 slots and at 1,
    fp32 and int4: the output is `none`'s, and drafts were verified (the calibration saw them)."""
    from qspec.compile import CompileOptions, compile_package
    from qspec.runtime import Engine, SamplingParams
    from qspec.specializations import make_config

    config = make_config(num_speculative_tokens="0,1,4", prefill_seq_len=8, ctx_len=64, full_batch_size=4)
    folder = tmp_path_factory.mktemp(f"survival-{weight_format}") / "pkg"
    options = CompileOptions(specialization=config, weight_format=weight_format)
    package = compile_package(tiny_model("llama"), options, output=folder)[0]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = greedy_none(package, params)
    for slots in (4, 1):
        engine = Engine(package, method="pld", proposer=SurvivalLookup(), max_batch_size=slots)
        assert [out.token_ids for out in engine.generate(PROMPTS, params)] == plain, slots
        assert engine.dispatcher.survival.tried.sum() > 0, slots  # drafts were verified, priced by their survival
