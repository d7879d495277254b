"""The call plan a trimmed runtime graph reads (qspec.backends.ort_plan): the host's arithmetic, case by case."""

from __future__ import annotations

import numpy as np

from qspec.backends import ort_plan
from qspec.backends.ort_plan import CallPlan, op_slots

TREE_NAMES = (ort_plan.OP_INDEX, ort_plan.QUERY)
PADDED = [name for name in ort_plan.NAMES if name not in TREE_NAMES]  # drafts (chains), the hidden_states output
LONE = [name for name in PADDED if name != ort_plan.QUERY_PADS]  # a package without drafts
TREE = [name for name in ort_plan.NAMES if name != ort_plan.QUERY_PADS]  # drafts verified as trees


def test_rows_of_a_verify_call():
    """A row of three live tokens, an idle row and a row of one: attention's chunks, the kept slots, the pads."""
    plan = CallPlan(rows=3, seq_len=5, keep=5, names=PADDED)
    plan.write(np.array([[10, 11, 12, -1, -1], [-1] * 5, [7, -1, -1, -1, -1]], np.int64))
    a = plan.arrays
    # row 0: 3 tokens from 10, ends at slot 12; row 2: its token and a zero token from 7 (seqlens_k = 8)
    assert a[ort_plan.SEQLENS_K].tolist() == [12, 0, 8]
    assert a[ort_plan.QUERY_SEQLENS].tolist() == [3, 0, 2]
    assert int(a[ort_plan.TOTAL_SEQUENCE_LENGTH]) == 13
    assert a[ort_plan.SEQ].tolist() == [3] and a[ort_plan.QUERY_PADS].tolist() == [0] * 6  # rows cut to 3
    # the last 5 slots up to each row's last live one, slot 0 repeated in front
    assert a[ort_plan.KEPT_SLOTS][:, :, 0].tolist() == [[0, 0, 0, 1, 2], [0] * 5, [0] * 5]
    assert a[ort_plan.SKIPPED].tolist() == [2]  # no row has more than 3 tokens: 2 of 5 kept entries are empty
    assert a[ort_plan.LOGITS_PADS].tolist() == [0, 2, 0, 0, 0, 0]
    assert a[ort_plan.HIDDEN_PADS].tolist() == [0, 0, 0, 0, 2, 0]  # hidden states back to seq_len 5


def test_one_token_call_padded_or_alone():
    """With drafts a lone token runs with a zero token after it (2 query tokens); without, alone."""
    positions = np.array([[41]], np.int64)
    padded, lone = CallPlan(1, 1, 1, PADDED), CallPlan(1, 1, 1, LONE)
    padded.write(positions)
    lone.write(positions)
    assert padded.arrays[ort_plan.QUERY_SEQLENS].tolist() == [2] and padded.arrays[ort_plan.SEQLENS_K].tolist() == [42]
    assert int(padded.arrays[ort_plan.TOTAL_SEQUENCE_LENGTH]) == 43
    assert padded.arrays[ort_plan.QUERY_PADS].tolist() == [0, 0, 0, 0, 1, 0]
    assert lone.arrays[ort_plan.QUERY_SEQLENS].tolist() == [1] and lone.arrays[ort_plan.SEQLENS_K].tolist() == [41]
    assert int(lone.arrays[ort_plan.TOTAL_SEQUENCE_LENGTH]) == 42 and ort_plan.QUERY_PADS not in lone.arrays


def test_a_4bit_product_is_widened_only_when_it_has_one_row():
    """A 4-bit graph's MatMulNBits get a zero row only where the call's product has one row (MLAS rounds a
    one-row product differently): one token in all, or one kept slot for the LM head; a verify call or a call
    of several rows runs its products as they are."""

    def widen(rows: int, seq_len: int, keep: int, positions: list[list[int]]) -> tuple:
        plan = CallPlan(rows, seq_len, keep, PADDED)
        plan.write(np.array(positions, np.int64))
        a = plan.arrays
        return (
            a[ort_plan.WIDEN_PADS].tolist(),
            int(a[ort_plan.WIDEN_ENDS][0]),
            a[ort_plan.KEPT_WIDEN_PADS].tolist(),
            int(a[ort_plan.KEPT_WIDEN_ENDS][0]),
        )

    whole = ort_plan.WHOLE_AXIS
    assert widen(1, 1, 1, [[41]]) == ([0, 1], -1, [0, 1], -1)  # a one-token call: both widened
    assert widen(1, 5, 5, [[41, 42, 43, 44, 45]]) == ([0, 0], whole, [0, 0], whole)  # a verify call: neither
    # the K=4 call with one live token: rows cut to one token, four of five kept slots skipped
    assert widen(1, 5, 5, [[41, -1, -1, -1, -1]]) == ([0, 1], -1, [0, 1], -1)
    assert widen(2, 1, 1, [[41], [-1]]) == ([0, 0], whole, [0, 0], whole)  # two rows: two rows a product


def test_an_idle_call_and_rewriting_in_place():
    """Every row idle: one padding token runs, nothing kept; the arrays are the same objects after each write."""
    plan = CallPlan(rows=2, seq_len=3, keep=3, names=PADDED)
    arrays = {name: id(array) for name, array in plan.arrays.items()}
    plan.write(np.array([[5, 6, 7], [9, -1, -1]], np.int64))
    plan.write(np.full((2, 3), -1, np.int64))
    a = plan.arrays
    assert {name: id(array) for name, array in a.items()} == arrays  # bound once, rewritten in place
    assert a[ort_plan.SEQLENS_K].tolist() == [0, 0] and a[ort_plan.QUERY_SEQLENS].tolist() == [0, 0]
    assert a[ort_plan.SEQ].tolist() == [1] and a[ort_plan.SKIPPED].tolist() == [3]
    assert int(a[ort_plan.TOTAL_SEQUENCE_LENGTH]) == 2  # the op's query: one token padded to two


def test_feeds_only_for_a_graph_that_reads_a_plan():
    """A graph that computes its own plan (continuous batching, older packages) gets no plan inputs."""
    positions = np.array([[3, 4]], np.int64)
    assert ort_plan.feeds(positions, 2, {"input_ids", "position_ids"}) == {}
    feeds = ort_plan.feeds(positions, 2, set(LONE))
    assert sorted(feeds) == sorted(LONE) and feeds[ort_plan.SEQLENS_K].tolist() == [4]


def test_a_draft_heads_plan_keeps_its_rows():
    """A head's graph (rows not cut, a lone query, one kept slot): the op sees seq_len tokens; a row's last live
    slot is the one whose feature the head returns."""
    names = [ort_plan.SEQLENS_K, ort_plan.QUERY_SEQLENS, ort_plan.TOTAL_SEQUENCE_LENGTH, ort_plan.KEPT_SLOTS]
    plan = CallPlan(rows=3, seq_len=5, keep=1, names=names)
    plan.write(np.array([[20, 21, -1, -1, -1], [7, -1, -1, -1, -1], [-1] * 5], np.int64))
    a = plan.arrays
    assert set(a) == set(names)
    assert a[ort_plan.SEQLENS_K].tolist() == [21, 7, 0] and a[ort_plan.QUERY_SEQLENS].tolist() == [2, 1, 0]
    assert int(a[ort_plan.TOTAL_SEQUENCE_LENGTH]) == 22
    assert a[ort_plan.KEPT_SLOTS][:, :, 0].tolist() == [[1], [0], [0]]
    plan.write(np.array([[0, -1, -1, -1, -1], [1, -1, -1, -1, -1], [-1] * 5], np.int64))
    assert int(a[ort_plan.TOTAL_SEQUENCE_LENGTH]) == 5  # at least the op's seq_len query tokens


def test_a_draft_off_the_chain_runs_a_lane_group_past_its_depth():
    """op_slots: the chain at its own slots, a sibling at the first free slot congruent to its depth modulo the
    lanes; the plan scatters each token there and the op runs up to the last one (holes included)."""
    assert op_slots([10, 11, 12, 11], 8) == [0, 1, 2, 9]
    assert op_slots([10, 11, 11], 8) == [0, 1, 9] and op_slots([10, 11, 12, 13], 8) == [0, 1, 2, 3]
    assert op_slots([10, 11, 12, 11], 1) == [0, 1, 2, 3]  # a kernel without lanes: no holes
    plan = CallPlan(rows=1, seq_len=5, keep=5, names=TREE, lanes=8)
    plan.write(np.array([[10, 11, 12, 11, -1]], np.int64))
    a = plan.arrays
    assert a[ort_plan.OP_INDEX][0, :, 1].tolist() == [0, 1, 2, 9, 10]  # the padding token after the last
    assert a[ort_plan.QUERY].tolist() == [10] and a[ort_plan.QUERY_SEQLENS].tolist() == [10]
    assert a[ort_plan.SEQLENS_K].tolist() == [19] and a[ort_plan.SEQ].tolist() == [4]
    assert a[ort_plan.KEPT_SLOTS][0, :, 0].tolist() == [0, 0, 1, 2, 3]  # logits of the live tokens, as a chain's
