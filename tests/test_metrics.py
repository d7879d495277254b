"""Serving metrics: acceptance per draft position from the (proposed, accepted) of each target call."""

from __future__ import annotations

import pytest

from qspec.runtime.metrics import RequestMetrics, acceptance_per_position, aggregate, step_times, sum_positions


def test_positions_count_the_calls_that_reached_each_draft():
    """3 drafts with 1 accepted, 2 with 2, none proposed: reached [2, 2, 0], accepted [2, 1, 0]."""
    m = RequestMetrics()
    m.target_call(4, proposed=3, accepted=1)
    m.target_call(2, proposed=2, accepted=2)
    m.target_call(0, proposed=0, accepted=0)
    assert m.reached_per_position == [2, 2, 0]  # draft 3 of the first call came after a rejected draft 2
    assert m.accepted_per_position == [2, 1, 0]
    assert acceptance_per_position(m.reached_per_position, m.accepted_per_position) == [1.0, 0.5, None]
    assert m.to_dict()["reached_per_position"] == [2, 2, 0]


def test_a_rejected_first_draft_reaches_position_one_only():
    """4 drafts, none accepted: only draft 1 was decided on."""
    m = RequestMetrics()
    m.target_call(4, proposed=4, accepted=0)
    assert (m.reached_per_position, m.accepted_per_position) == ([1, 0, 0, 0], [0, 0, 0, 0])


def test_aggregate_sums_positions_over_requests_of_different_depths():
    """Requests with 1 and 3 positions sum element-wise; the rates are over the sums."""
    a, b = RequestMetrics(), RequestMetrics()
    a.target_call(1, proposed=1, accepted=1)
    b.target_call(4, proposed=3, accepted=3)
    b.target_call(4, proposed=3, accepted=0)
    engine = aggregate([a, b], 1.0, {})
    assert engine.reached_per_position == [3, 1, 1]
    assert engine.accepted_per_position == [2, 1, 1]
    assert engine.acceptance_per_position == [round(2 / 3, 4), 1.0, 1.0]
    assert engine.mean_accepted_tokens == round((4 + 3) / 3, 4)  # accepted drafts + 1 per call
    assert sum_positions([]) == [] and aggregate([], 1.0, {}).acceptance_per_position == []


def test_host_time_is_the_wall_outside_the_calls_and_drafting_per_decode_step():
    """10 s of wall, 1 s prefill, 8 s in decode calls, 0.5 s drafting over 1,000 decode calls: 0.5 ms a step,
    0.5 / 9 of a step's time. Without decode calls or timings (a baseline) there is nothing to say."""
    seconds = {"prefill": 1.0, "decode": 8.0, "propose": 0.5}
    step = step_times(10.0, {"prefill": 4, "0": 600, "4": 400}, seconds)
    assert step.host_ms == pytest.approx(0.5) and step.host_share == pytest.approx(0.5 / 9)
    assert (step.steps, step.step_ms, step.target_ms, step.drafting_ms) == pytest.approx((1000, 9.0, 8.0, 0.5))
    assert step_times(10.0, {"prefill": 4}, seconds) is None
    assert step_times(10.0, {"forward": 100}, {}) is None
    assert aggregate([], 1.0, {}, seconds).seconds == seconds
