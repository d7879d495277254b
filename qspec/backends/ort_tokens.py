"""Token-wise nodes of the embedded backend's graph on live tokens only, for :mod:`qspec.backends.ort_attention`.

With several KV rows the call's live tokens are packed (``[1, live, width]``, :func:`pack_live_tokens`);
with one, each row is cut to the call's most live tokens (:func:`trim_rows`); either way the graph's
outputs are put back in the contract's shapes (logits, and :func:`restore_hidden_states`). The module
docstring of :mod:`qspec.backends.ort_attention` says why and how attention pads around them.
"""

from __future__ import annotations

import numpy as np

from qspec import contract
from qspec.backends import ort_plan


def initializer(graph, name: str, array: np.ndarray):
    """An initializer ``name`` of ``graph`` holding ``array``."""
    import onnx_ir as ir

    value = ir.Value(name=name)
    value.const_value = ir.tensor(array, name=name)
    value.shape, value.type = ir.Shape(array.shape), ir.TensorType(value.const_value.dtype)
    graph.register_initializer(value)
    return value


def pack_live_tokens(graph, inputs, shared: dict) -> None:
    """Run every token-wise node on the call's live tokens only: the embedding reads the live tokens'
    ids (``[1, live]``), and the final norm and LM head run on the live tokens whose logits the call
    keeps (the epilogue's ``GatherElements`` picks the last ``num_logits_to_keep`` slots of each row),
    their logits scattered to ``[batch, keep, vocab]``: a row's entries before its first live token are
    zeros (the vendor graph repeats the first token's there; no caller reads them).

    With several KV rows a call pads every row to its longest one (a batch-4 K=4 call where one row
    drafts runs 20 tokens, 8 of them live); the weights' MatMuls then cost what the live tokens cost.
    Attention moves its live tokens to ``[kv_rows, query]`` and back (:func:`_to_kv_slots`, GatherND).
    """
    import onnx_ir as ir

    ids = inputs[contract.INPUT_IDS]
    embed, (index, logits), pick = token_ends(graph, ids, "packing live tokens")
    nodes = []
    op, constant = builder(graph, nodes, "tokens")

    axis0, axis1 = constant("axis0", np.array([0], np.int64)), constant("axis1", np.array([1], np.int64))
    zero, one = constant("zero", np.array(0, np.int64)), constant("one", np.array(1, np.int64))
    embed.replace_input_with(1, op("GatherND", ids, shared["live_tokens"]))  # [1, live]
    # Each live token's entry among its row's kept logits: slot - last + keep - 1 (kept when >= 0).
    positions = inputs[contract.POSITION_IDS]
    call_shape = op("Shape", positions)  # [batch, seq]
    steps = op("Range", zero, op("Gather", call_shape, one), one)
    valid = op("Cast", op("GreaterOrEqual", positions, zero), to=ir.DataType.INT64)
    last = op("ReduceMax", op("Mul", valid, steps), axis1, keepdims=0)  # [batch]: each row's last live slot
    keeps = inputs.get(contract.NUM_LOGITS_TO_KEEP)
    keep = op("Gather", op("Shape", keeps), zero) if keeps is not None else one
    entry = op("Sub", op("Add", shared["live_slots"], op("Sub", keep, one)), op("Gather", last, shared["live_rows"]))
    kept = op("Squeeze", op("NonZero", op("GreaterOrEqual", entry, zero)), axis0)  # [kept]: indices of live tokens
    hidden = op("Gather", pick.inputs[0], kept, axis=1)  # [1, kept, hidden]
    targets = op(
        "Concat",
        op("Unsqueeze", op("Gather", shared["live_rows"], kept), axis1),
        op("Unsqueeze", op("Gather", entry, kept), axis1),
        axis=1,
    )  # [kept, 2]: row, entry
    pick.outputs[0].replace_all_uses_with(hidden)
    vocab = op("Shape", logits, start=2)
    shape = op("Concat", op("Gather", call_shape, axis0), op("Unsqueeze", keep, axis0), vocab, axis=0)
    zeros = op("Expand", constant("zero_float", np.zeros(1, np.float32)), shape)
    scatter = ir.node("ScatterND", [zeros, op("Unsqueeze", targets, axis0), logits], name="tokens.logits")
    nodes.append(scatter)
    out = scatter.outputs[0]
    out.shape, out.type = logits.shape, logits.type
    logits.name = "tokens.live_logits"
    out.name = contract.LOGITS
    graph.outputs[index] = out
    graph.extend(nodes)


def token_ends(graph, ids, purpose: str):
    """``(embedding, (index, logits), pick)``: the embedding ``Gather`` of ``ids``, the logits output
    and its index among the graph's outputs, and the epilogue's ``GatherElements`` that picks the
    hidden states of the kept tokens (found back from the logits through the LM head and the final
    norm). A ``ValueError`` naming ``purpose`` when either is not found once."""
    embeds = [node for node, i in ids.uses() if node.op_type == "Gather" and i == 1 and node.inputs[0].is_initializer()]
    if len(embeds) != 1:
        raise ValueError(f"{purpose} needs one embedding Gather of input_ids")
    index, logits = next((i, v) for i, v in enumerate(graph.outputs) if v.name == contract.LOGITS)
    pick = logits.producer()
    for _ in range(8):
        if pick is None or pick.op_type == "GatherElements":
            break
        pick = pick.inputs[0].producer()
    if pick is None or pick.op_type != "GatherElements":
        raise ValueError(f"{purpose} needs the epilogue's logits GatherElements")
    return embeds[0], (index, logits), pick


def builder(graph, nodes: list, prefix: str):
    """``op(op_type, *inputs, **attributes)``: a node named ``{prefix}.{op_type}.{n}`` appended to
    ``nodes``, its output returned; ``constant(name, array)``: an initializer ``{prefix}.{name}``."""
    import onnx_ir as ir

    def op(op_type: str, *args, **attributes) -> ir.Value:
        node = ir.node(op_type, list(args), attributes=attributes, name=f"{prefix}.{op_type}.{len(nodes)}")
        nodes.append(node)
        return node.outputs[0]

    def constant(name: str, array: np.ndarray) -> ir.Value:
        return initializer(graph, f"{prefix}.{name}", array)

    return op, constant


def trim_rows(graph, inputs, shared: dict) -> None:
    """Run every node but attention on each row's first ``seq`` tokens (``shared["seq_1d"]``: the
    call's most live tokens in a row, at least one), for a graph without ``batch_index``.

    Rows are right-padded (the contract's epilogue reads them so): a row's live tokens are its first
    slots. The embedding reads ``input_ids`` cut to ``seq`` columns; attention pads its q, k, v to
    ``query`` tokens and slices its output back, as a one-slot graph always did (see the module doc).
    A K=4 call whose row drafts 2 tokens runs 3 tokens through the MatMuls, not 5. The epilogue picks
    the hidden states of the last ``num_logits_to_keep`` live tokens of each row on the trimmed rows
    (the exported pick counts slots up to the hidden states' length, now ``seq``), and the final norm
    and LM head run on the last ``min(keep, seq)`` picks, the logits padded back to ``keep`` in front.
    Every index comes from the host's call plan (``shared["plan"]``, :mod:`qspec.backends.ort_plan`).
    """
    ids = inputs[contract.INPUT_IDS]
    embed, (index, logits), pick = token_ends(graph, ids, "trimming rows")
    plan = shared["plan"]
    nodes = []
    op, constant = builder(graph, nodes, "rows")

    axis1 = shared["axis1"]
    embed.replace_input_with(1, op("Slice", ids, shared["zero_1d"], shared["seq_1d"], axis1))
    # [rows, keep, hidden]: each row's kept slots (GatherND over the rows: the exported GatherElements
    # wanted its indices expanded to the hidden width)
    gathered = op("GatherND", pick.inputs[0], plan[ort_plan.KEPT_SLOTS], batch_dims=1)
    # The final norm and LM head run on the last min(keep, most live tokens in a row) picks; the
    # logits entries before them are zeros (as a packed graph's: no caller reads them).
    end = constant("end", np.array([np.iinfo(np.int64).max], np.int64))
    picked = op("Slice", gathered, plan[ort_plan.SKIPPED], end, axis1)  # [rows, kept, hidden]
    pick.outputs[0].replace_all_uses_with(picked)
    out = op("Pad", logits, plan[ort_plan.LOGITS_PADS])  # [rows, keep, vocab]
    out.shape, out.type = logits.shape, logits.type
    logits.name = "rows.live_logits"
    out.name = contract.LOGITS
    graph.outputs[index] = out
    graph.extend(nodes)


def restore_hidden_states(graph, inputs, shared: dict, *, packed: bool, name: str = contract.HIDDEN_STATES) -> None:
    """The ``hidden_states`` output (or another per-token output ``name``, a tap) back in the contract's
    ``[batch, seq_len, hidden]``: its norm ran on the live tokens only (``[1, live, hidden]`` packed,
    ``[rows, seq, hidden]`` trimmed); the other entries are zeros (padding has no hidden state a caller reads)."""
    import onnx_ir as ir

    index, hidden = next((i, v) for i, v in enumerate(graph.outputs) if v.name == name)
    nodes = []
    prefix = "hidden" if name == contract.HIDDEN_STATES else name
    op, constant = builder(graph, nodes, prefix)
    if packed:
        axis0 = constant("axis0", np.array([0], np.int64))
        call_shape = op("Shape", inputs[contract.POSITION_IDS])  # [batch, seq]
        shape = op("Concat", call_shape, op("Shape", hidden, start=2), axis=0)
        zeros = op("Expand", constant("zero_float", np.zeros(1, np.float32)), shape)
        axis1 = constant("axis1", np.array([1], np.int64))
        rows, slots = (op("Unsqueeze", shared[name], axis1) for name in ("live_rows", "live_slots"))
        targets = op("Concat", rows, slots, axis=1)  # [live, 2]: row, slot
        out = op("ScatterND", zeros, op("Unsqueeze", targets, axis0), hidden)
    else:  # [rows, seq, hidden] padded at the end of axis 1 (the host's call plan has the pads)
        out = op("Pad", hidden, shared["plan"][ort_plan.HIDDEN_PADS])
    out.shape, out.type = ir.Shape(list(hidden.shape)), hidden.type  # a copy: inference may reshape `hidden`
    hidden.name = f"{prefix}.live_{name}"
    out.name = name
    graph.outputs[index] = out
    graph.extend(nodes)


def pad_one_more_token(graph) -> int:
    """Every call of a graph whose attention stays as exported (DeepSeek-V3's MLA, Gemma 3) runs one padding
    token more: ``input_ids`` 0 and ``position_ids`` ``PAD_POSITION`` appended to each row, and each per-token
    output (``hidden_states``, taps) cut back to the call's ``seq_len``; returns how many outputs were cut.

    ONNX Runtime's MatMul rounds a product of one row differently from the same row among several (MLAS sums
    a lone row in another order); a one-token decode call would then round differently from the same token in
    a verify call, and speculative greedy output would not be plain greedy output. With the padding token every
    MatMul sees at least two rows. The contract makes the padding token harmless: it writes back the value its
    slot holds and gets no logits. Example: a decode call ``[[t]]`` at ``[[9]]`` runs ``[[t, 0]]`` at
    ``[[9, -1]]``; its logits and KV are those of ``[[t]]`` computed as two rows.
    """
    nodes = []
    op, constant = builder(graph, nodes, "one_more")
    ids = next(v for v in graph.inputs if v.name == contract.INPUT_IDS)
    seq = op("Slice", op("Shape", ids), *(constant(n, np.array([v], np.int64)) for n, v in (("one", 1), ("two", 2))))
    # [0, 0, 0, 1] for a one-token call, else zeros: a longer call has its rows already (and a chunk of
    # ctx_len tokens has no free slot for one more)
    lone = op("Cast", op("Equal", seq, constant("lone", np.array([1], np.int64))), to=7)  # int64
    pads = op("Concat", constant("pads_begin", np.zeros(3, np.int64)), lone, axis=0)
    for name, fill in ((contract.INPUT_IDS, 0), (contract.POSITION_IDS, contract.PAD_POSITION)):
        value = next(v for v in graph.inputs if v.name == name)
        uses = [(user, index) for user, index in value.uses() if user not in nodes]
        padded = op("Pad", value, pads, constant(f"{name}_fill", np.array(fill, np.int64)))
        for user, index in uses:
            user.replace_input_with(index, padded)
    graph.insert_before(graph[0], nodes)  # ahead of every user
    per_token = [
        (i, out)
        for i, out in enumerate(graph.outputs)
        if out.name == contract.HIDDEN_STATES or out.name.startswith("tap.")
    ]
    if per_token:
        start, axis1 = constant("start", np.array([0], np.int64)), constant("axis1", np.array([1], np.int64))
    for index, out in per_token:
        tail = []
        step, _ = builder(graph, tail, f"one_more.{out.name}")
        sliced = step("Slice", out, start, seq, axis1)  # [batch, seq, width]: the padding token's row dropped
        sliced.shape, sliced.type = out.shape, out.type
        name, out.name, out.shape = out.name, f"one_more.padded_{out.name}", None
        sliced.name = name
        graph.outputs[index] = sliced
        graph.extend(tail)
    return len(per_token)
