"""A trimmed runtime graph's call plan: the small per-call inputs the host computes from ``position_ids``.

A graph without ``batch_index`` (:func:`qspec.backends.ort_tokens.trim_rows`) needs, besides the
contract's inputs, a handful of integers that follow from the call's positions: what each row's
``GroupQueryAttention`` reads (``seqlens_k``, ``query_seqlens``, ``total_sequence_length``), how many tokens
the rows are cut to, how far attention pads them, which hidden states the LM head reads and how the
outputs are padded back. Computed in the graph they are ≈ 50 small nodes a call, each a kernel launch and
the executor's bookkeeping (``docs/perf.md`` has what they cost); the host computes them from the
``position_ids`` it has just written, in microseconds, and binds them as inputs.

The graph side (:func:`add_inputs`) declares the inputs; the host side (:class:`CallPlan`) holds a
binding's arrays and rewrites them in place before each call (:meth:`CallPlan.write`). A draft head's
graph (:func:`qspec.heads.ort_graph.fuse_eagle`) takes a smaller plan: its rows are not cut (the op sees
the call's ``seq_len`` tokens), it runs a lone query (a draft needs no exactness) and reads one kept slot
per row, the row's last live token. The arithmetic
is the contract's (``docs/how-it-works.md``): a row's live tokens are its first slots, at consecutive
positions ``p .. p + n - 1``; an idle row has none.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from qspec import contract
from qspec.package import MIN_QUERY_TOKENS

SEQLENS_K = "plan_seqlens_k"  # int32 [batch_size]: GroupQueryAttention's seqlens_k of each row
QUERY_SEQLENS = "plan_query_seqlens"  # int32 [batch_size]: its query tokens of each row (0: idle)
TOTAL_SEQUENCE_LENGTH = "plan_total_sequence_length"  # int32 []: the longest row's slots, at least the query
SEQ = "plan_seq"  # int64 [1]: the call's most live tokens in a row, at least one (rows are cut to it)
QUERY_PADS = "plan_query_pads"  # int64 [6]: Pad of q/k/v [rows, seq, width] to the op's query tokens
KEPT_SLOTS = "plan_kept_slots"  # int64 [batch_size, keep, 1]: each row's slots whose logits are kept
SKIPPED = "plan_skipped"  # int64 [1]: leading kept entries no row fills (the LM head skips them)
LOGITS_PADS = "plan_logits_pads"  # int64 [6]: Pad of the LM head's [rows, keep - skipped, vocab] to keep
HIDDEN_PADS = "plan_hidden_pads"  # int64 [6]: Pad of the hidden states [rows, seq, hidden] to seq_len
# A 4-bit graph widens a product of one row to two (qspec.backends.ort_quantize.widen_one_row_matmuls): the Pad
# of its rows axis and the Slice end that drops the added row again, for the products on the call's tokens and
# for those after the kept-rows gather (the LM head's).
WIDEN_PADS = "plan_widen_pads"  # int64 [2]: [0, 1] when the call has one token in all, else [0, 0]
WIDEN_ENDS = "plan_widen_ends"  # int64 [1]: -1 with that pad, else the end of the axis
KEPT_WIDEN_PADS = "plan_kept_widen_pads"  # int64 [2]: the same for the kept rows (one row, one kept slot)
KEPT_WIDEN_ENDS = "plan_kept_widen_ends"  # int64 [1]
WHOLE_AXIS = np.iinfo(np.int64).max
# A graph that verifies trees places each token at its own slot of the op's query (op_slots):
OP_INDEX = "plan_op_index"  # int64 [batch_size, seq_len, 2]: (row, op slot) of each of a row's tokens
QUERY = "plan_query"  # int64 [1]: the op's query tokens per row
KEPT_ROWS = "kept_rows"  # a draft head's kept slots per row (the symbol of KEPT_SLOTS' second axis)

NAMES = (
    SEQLENS_K,
    QUERY_SEQLENS,
    TOTAL_SEQUENCE_LENGTH,
    SEQ,
    QUERY_PADS,
    KEPT_SLOTS,
    SKIPPED,
    LOGITS_PADS,
    HIDDEN_PADS,
    OP_INDEX,
    QUERY,
    WIDEN_PADS,
    WIDEN_ENDS,
    KEPT_WIDEN_PADS,
    KEPT_WIDEN_ENDS,
)


def op_slots(positions: list[int], lanes: int) -> list[int]:
    """Where the op runs each of a row's live tokens (``positions``: ``[last, drafts...]`` of a verify row, or a
    chunk's): the top-1 chain (positions ``p, p + 1, ...``) at its own slots, every later token (off the chain,
    :mod:`qspec.runtime.layout`) at the first free slot ``s`` with ``s = depth (mod lanes)``: ONNX Runtime's CPU
    kernel sums a softmax in ``lanes`` lanes, so a token ``lanes`` slots past its depth rounds as it would at
    its depth in a plain call (docs/how-it-works.md). ``[10, 11, 12, 11]`` with 8 lanes: ``[0, 1, 2, 9]``."""
    if not positions:
        return []
    first, slots, on_chain = positions[0], [0], True
    for i, position in enumerate(positions[1:], 1):
        on_chain = on_chain and position == first + i
        if on_chain:
            slots.append(i)
            continue
        depth, low = position - first, slots[-1] + 1
        slots.append(low + (depth - low) % lanes)
    return slots


def add_inputs(
    graph, *, hidden_states: bool, query_pads: bool = True, cut: bool = True, tree: bool = False
) -> dict[str, object]:
    """Declare the plan's inputs on an ``onnx_ir`` graph; ``{name: value}`` (no hidden pads without that output,
    no query pads for a graph whose attention runs a lone query). ``cut=False``: a graph whose rows keep
    their ``seq_len`` tokens (a draft head's) only takes attention's integers and the kept slots."""
    import onnx_ir as ir

    keep = contract.NUM_LOGITS_TO_KEEP if contract.NUM_LOGITS_TO_KEEP in {v.name for v in graph.inputs} else 1
    if not cut:  # a draft head's: one kept row a call when chained, K when it drafts K in one call
        keep = KEPT_ROWS
    shapes = {
        SEQLENS_K: (ir.DataType.INT32, [contract.BATCH_SIZE]),
        QUERY_SEQLENS: (ir.DataType.INT32, [contract.BATCH_SIZE]),
        TOTAL_SEQUENCE_LENGTH: (ir.DataType.INT32, []),
        SEQ: (ir.DataType.INT64, [1]),
        QUERY_PADS: (ir.DataType.INT64, [6]),
        KEPT_SLOTS: (ir.DataType.INT64, [contract.BATCH_SIZE, keep, 1]),
        SKIPPED: (ir.DataType.INT64, [1]),
        LOGITS_PADS: (ir.DataType.INT64, [6]),
    }
    if hidden_states:
        shapes[HIDDEN_PADS] = (ir.DataType.INT64, [6])
    if tree:  # q/k/v go to their op slots (ScatterND), not padded at the end
        shapes[OP_INDEX] = (ir.DataType.INT64, [contract.BATCH_SIZE, contract.SEQ_LEN, 2])
        shapes[QUERY] = (ir.DataType.INT64, [1])
        del shapes[QUERY_PADS]
    if not query_pads:
        del shapes[QUERY_PADS]
    if not cut:
        for name in (SEQ, QUERY_PADS, SKIPPED, LOGITS_PADS, HIDDEN_PADS):
            shapes.pop(name, None)
    values = {}
    for name, (dtype, dims) in shapes.items():
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))
        graph.inputs.append(value)
        values[name] = value
    return values


class CallPlan:
    """A binding's plan arrays (rows, ``seq_len``, ``keep`` fixed), rewritten in place by :meth:`write`.

    ``names``: the plan inputs the graph has (a graph without the ``hidden_states`` output has no hidden pads).
    A graph without query pads runs a lone query token (``min_query`` 1); the others pad a one-token row to
    ``MIN_QUERY_TOKENS``. A graph without ``plan_seq`` does not cut its rows: the op sees ``seq_len`` tokens.
    """

    def __init__(self, rows: int, seq_len: int, keep: int, names: Collection[str], *, lanes: int = 1):
        self.seq_len, self.keep = seq_len, keep
        self.tree = OP_INDEX in names
        self.lanes = lanes  # a tree graph's softmax lanes (op_slots)
        self.min_query = MIN_QUERY_TOKENS if QUERY_PADS in names or self.tree else 1
        self.cut = SEQ in names
        arrays = {
            SEQLENS_K: np.zeros(rows, np.int32),
            QUERY_SEQLENS: np.zeros(rows, np.int32),
            TOTAL_SEQUENCE_LENGTH: np.zeros((), np.int32),
            SEQ: np.zeros(1, np.int64),
            QUERY_PADS: np.zeros(6, np.int64),
            KEPT_SLOTS: np.zeros((rows, keep, 1), np.int64),
            SKIPPED: np.zeros(1, np.int64),
            LOGITS_PADS: np.zeros(6, np.int64),
            HIDDEN_PADS: np.zeros(6, np.int64),
            OP_INDEX: np.zeros((rows, seq_len, 2), np.int64),
            QUERY: np.zeros(1, np.int64),
            WIDEN_PADS: np.zeros(2, np.int64),
            WIDEN_ENDS: np.full(1, WHOLE_AXIS, np.int64),
            KEPT_WIDEN_PADS: np.zeros(2, np.int64),
            KEPT_WIDEN_ENDS: np.full(1, WHOLE_AXIS, np.int64),
        }
        self.arrays = {name: array for name, array in arrays.items() if name in names}
        self._steps = list(range(1 - keep, 1))  # slot offsets from a row's last

    def write(self, positions: np.ndarray) -> None:
        """The plan of a call with ``positions`` ``[rows, seq_len]`` (right-padded rows), into the arrays.

        Plain Python over the rows (a handful): a few microseconds, where numpy's per-call overhead
        would cost more than the arithmetic."""
        a = self.arrays
        seqlens_k, query_seqlens, slots = a[SEQLENS_K], a[QUERY_SEQLENS], a[KEPT_SLOTS]
        most, total, end = 0, 0, 0
        rows = positions.tolist()
        for row, live in enumerate(rows):
            count = sum(1 for position in live if position >= 0)
            most = max(most, count)
            if self.tree:  # the row's tokens at their op slots; its padding tokens after them
                placed = op_slots(live[:count], self.lanes)
                end = placed[-1] + 1 if placed else 0
                a[OP_INDEX][row, :, 0] = row
                a[OP_INDEX][row, :count, 1] = placed
                a[OP_INDEX][row, count:, 1] = range(end, end + self.seq_len - count)
            op_count = max(count, end) if self.tree else count  # the op's tokens of the row: holes included
            # A live row runs its live tokens, at least min_query, from its first position p (its first slot; a
            # tree's siblings share positions, not slots): seqlens_k = p + row_query - 1.
            row_query = max(op_count, self.min_query) if count else 0
            row_seqlens_k = live[0] + row_query - 1 if count else 0
            seqlens_k[row], query_seqlens[row] = row_seqlens_k, row_query
            total = max(total, row_seqlens_k + 1)
            # The last `keep` slots up to the row's last live one (slot 0 repeated before the first).
            last = max(count - 1, 0)
            slots[row, :, 0] = [max(last + step, 0) for step in self._steps]
        seq = max(most, 1) if self.cut else self.seq_len  # cut: an idle call still runs one padding token
        query = max(seq, self.min_query)
        if self.tree:  # every row's op slots and the padding tokens placed after them
            query = max([query] + [int(a[OP_INDEX][row, seq - 1, 1]) + 1 for row in range(len(rows))])
            a[QUERY][0] = query
        a[TOTAL_SEQUENCE_LENGTH][...] = max(total, query)
        if not self.cut:
            return
        a[SEQ][0] = seq
        if QUERY_PADS in a:
            a[QUERY_PADS][4] = query - seq
        skipped = self.keep - min(self.keep, most)
        a[SKIPPED][0] = skipped
        a[LOGITS_PADS][1] = skipped
        if HIDDEN_PADS in a:
            a[HIDDEN_PADS][4] = self.seq_len - seq
        # A product of one row (one row of one token; one kept slot) is widened to two, every other runs as it is.
        for pads, ends, count in (
            (WIDEN_PADS, WIDEN_ENDS, len(rows) * seq),
            (KEPT_WIDEN_PADS, KEPT_WIDEN_ENDS, len(rows) * (self.keep - skipped)),
        ):
            if pads in a:
                a[pads][1] = 1 if count == 1 else 0
                a[ends][0] = -1 if count == 1 else WHOLE_AXIS


def plan_names(input_names: Collection[str]) -> list[str]:
    """The plan inputs among a graph's inputs (none: the graph computes its plan, or has no such inputs)."""
    return [name for name in NAMES if name in input_names]


def feeds(positions: np.ndarray, keep: int, input_names: Collection[str]) -> dict[str, np.ndarray]:
    """The plan inputs for a call with ``positions``, for a caller that feeds a session by name."""
    names = plan_names(input_names)
    if not names:
        return {}
    plan = CallPlan(positions.shape[0], positions.shape[1], keep, names)
    plan.write(np.asarray(positions, dtype=np.int64))
    return plan.arrays
