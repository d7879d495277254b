"""The node builders of :func:`qspec.backends.ort_attention.fuse_attention`: the packed q/k/v projection, the
KV reshapes (rows, slots), the padded query, the per-head and full q/k norms."""

from __future__ import annotations

import contextlib

import numpy as np

from qspec import contract
from qspec.backends import ort_plan
from qspec.backends.ort_tokens import initializer
from qspec.package import AttentionInfo


def retain(graph, outputs: dict, *pairs) -> None:
    """The op's present K/V become the graph's ``_RetainedState`` outputs of their past buffers."""
    for buffer, present in pairs:
        index, old = outputs[contract.retained(buffer.name)]
        present.name, present.shape, present.type = old.name, old.shape, old.type
        old.name = None
        graph.outputs[index] = present


def projection_outputs(graph) -> dict[str, object]:
    """``{module path: its output value}`` for every ``MatMul(x, <path>.weight)`` (+ bias ``Add``)."""
    found = {}
    for node in graph:
        if node.op_type != "MatMul" or len(node.inputs) != 2 or node.inputs[1] is None:
            continue
        name = node.inputs[1].name or ""
        if not name.endswith(".weight") or not node.inputs[1].is_initializer():
            continue
        out = node.outputs[0]
        users = list(out.uses())
        if len(users) == 1 and users[0][0].op_type == "Add":  # a projection with a bias
            add = users[0][0]
            other = add.inputs[1 - users[0][1]]
            if other is not None and other.is_initializer():
                out = add.outputs[0]
        found[name.removesuffix(".weight")] = out
    return found


def packed_qkv(graph, nodes: list, outputs, prefix: str):
    """``[batch, seq, (heads + 2 kv_heads) * head_dim]`` from one MatMul (+ bias Add) in place of three."""
    import onnx_ir as ir

    matmuls, biases = [], []
    for out in outputs:
        node = out.producer()
        if node.op_type == "Add":  # MatMul + bias (see _projection_outputs)
            biases.append(next(v for v in node.inputs if v.is_initializer()))
            node = next(v for v in node.inputs if not v.is_initializer()).producer()
        matmuls.append(node)

    def packed(name: str, values, axis: int) -> ir.Value:
        # Lazy: concatenated when written or quantized, so the graph never holds every layer's packed copy.
        parts = [v.const_value for v in values]
        dims = list(parts[0].shape)
        dims[axis] = sum(part.shape[axis] for part in parts)

        def concatenate():
            array = np.concatenate([part.numpy() for part in parts], axis=axis)
            for part in parts:  # unmap the parts read from the vendor graph's file: their pages count as ours
                if isinstance(part, ir.ExternalTensor):
                    with contextlib.suppress(BufferError):
                        part.release()
            return ir.tensor(array, name=name)

        tensor = ir.LazyTensor(concatenate, dtype=parts[0].dtype, shape=ir.Shape(dims), name=name)
        value = ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(tensor.dtype), const_value=tensor)
        graph.register_initializer(value)
        return value

    weight = packed(prefix + "qkv_proj.weight", [m.inputs[1] for m in matmuls], axis=1)  # [in, q + k + v]
    node = ir.node("MatMul", [matmuls[0].inputs[0], weight], name=prefix + "qkv_proj")
    nodes.append(node)
    if biases:
        node = ir.node(
            "Add", [node.outputs[0], packed(prefix + "qkv_proj.bias", biases, axis=0)], name=prefix + "qkv_bias"
        )
        nodes.append(node)
    return node.outputs[0]


def to_kv_rows(nodes: list, x, zeros, shared: dict, name: str):
    """``x`` ``[batch, seq, width]`` scattered to its ``batch_index`` rows of ``zeros`` ``[kv_rows, seq, width]``."""
    import onnx_ir as ir

    node = ir.node("ScatterND", [zeros, shared["batch_index"], x], name=f"{name}.to_kv_rows")
    nodes.append(node)
    return node.outputs[0]


def to_kv_slots(nodes: list, x, zeros, shared: dict, name: str):
    """``x`` ``[1, live, width]`` (the call's live tokens) scattered to their KV rows and slots of ``zeros``."""
    import onnx_ir as ir

    node = ir.node("ScatterND", [zeros, shared["kv_slots"], x], name=f"{name}.to_kv_slots")
    nodes.append(node)
    return node.outputs[0]


def pad_tokens(nodes: list, x, shared: dict, name: str):
    """``x`` ``[rows, seq, width]`` with zero tokens appended up to ``[rows, query, width]``."""
    import onnx_ir as ir

    node = ir.node("Pad", [x, shared["query_pads"]], name=f"{name}.to_query")
    nodes.append(node)
    return node.outputs[0]


def head_norm(graph, nodes: list, x, module: str, attention: AttentionInfo, num_heads: int):
    """RMSNorm of each head of ``x`` ``[batch, seq, heads * head_dim]`` with ``<module>.weight``: 3 nodes.

    The shapes name every size but batch and seq (no ``-1``): a call with no live token has seq 0.
    """
    import onnx_ir as ir

    dims = [0, 0, num_heads, attention.head_dim]
    heads = initializer(graph, f"{module}.heads_shape", np.array(dims, dtype=np.int64))
    flat = initializer(graph, f"{module}.flat_shape", np.array([0, 0, num_heads * attention.head_dim], dtype=np.int64))
    split = ir.node("Reshape", [x, heads], name=f"{module}.split_heads")
    norm = ir.node(
        "SimplifiedLayerNormalization",
        [split.outputs[0], graph.initializers[module + ".weight"]],
        attributes={"axis": -1, "epsilon": float(attention.qk_norm_eps), "stash_type": 1},
        name=f"{module}.norm",
    )
    join = ir.node("Reshape", [norm.outputs[0], flat], name=f"{module}.join_heads")
    nodes.extend((split, norm, join))
    return join.outputs[0]


def full_norm(nodes: list, x, weight, attention: AttentionInfo):
    """RMSNorm of ``x`` ``[batch, seq, width]`` over its whole width (all heads at once) with ``weight``."""
    import onnx_ir as ir

    norm = ir.node(
        "SimplifiedLayerNormalization",
        [x, weight],
        attributes={"axis": -1, "epsilon": float(attention.qk_norm_eps), "stash_type": 1},
        name=f"{weight.name.removesuffix('.weight')}.norm",
    )
    nodes.append(norm)
    return norm.outputs[0]


def to_op_slots(nodes: list, x, zeros, shared: dict, name: str):
    """``x`` ``[rows, seq, width]`` at its op slots (``shared["op_index"]``) of ``zeros`` ``[rows, query, width]``."""
    import onnx_ir as ir

    node = ir.node("ScatterND", [zeros, shared["op_index"], x], name=f"{name}.to_op_slots")
    nodes.append(node)
    return node.outputs[0]


def tree_inputs(graph, positions, shared: dict, attention: AttentionInfo) -> dict:
    """What GroupQueryAttention reads for verify rows that may be trees (:mod:`qspec.runtime.layout`), on a
    graph with the host's call plan (:func:`qspec.backends.ort_plan.op_slots`): ~30 small nodes a call, shared
    by the layers. ``op_index`` ``[rows, seq, 2]``: each token's op slot; ``op_zeros``: ``[rows, query, width]``
    zeros to scatter q/k/v into; ``op_positions`` ``[rows, query]`` (holes and padding at 0): the op rotates
    each token by its own position; ``tree_bias`` ``[rows, 1, query, total]``: of the row's own slots a token
    sees itself and the chain's tokens before its position (0), not the rest (``-inf``); the slots before the
    row's first position are 0.

    The op writes a row's op slot ``s`` at KV slot ``p + s`` and lets it see slots ``[0, p + s]``. A tree row is
    ``[last, chain..., others...]``: the chain at its own slots (positions ``p, p + 1, ...``), a draft off the
    chain a multiple of the softmax's lanes past the slot of its depth (``op_slots``): ``[10, 11, 12, 11]`` runs
    as slots ``0, 1, 2, 9``, the one at 9 rotated as position 11 and seeing slots ``0..10`` and 19 only. On a
    chain the bias is all zeros and the slots are the tokens' own: the same logits bit for bit.
    """
    import onnx_ir as ir

    from qspec.backends.ort_tokens import builder

    plan = shared["plan"]
    nodes = []
    op, constant = builder(graph, nodes, "tree")
    zero, one = constant("zero", np.array(0, np.int64)), constant("one", np.array(1, np.int64))
    axis0, axis1 = constant("axis0", np.array([0], np.int64)), constant("axis1", np.array([1], np.int64))
    axis2 = constant("axis2", np.array([2], np.int64))
    op_index = op("Slice", plan[ort_plan.OP_INDEX], shared["zero_1d"], shared["seq_1d"], axis1)  # [rows, seq, 2]
    query_1d = plan[ort_plan.QUERY]
    rows_1d = op("Shape", positions, end=1)
    grid = op("Concat", rows_1d, query_1d, axis=0)  # [rows, query]
    heads = (attention.num_heads, attention.num_kv_heads, attention.num_heads + 2 * attention.num_kv_heads)
    zero_f = constant("zero_float_1d", np.zeros(1, np.float32))
    op_zeros = {
        w: op("Expand", zero_f, op("Concat", grid, constant(f"width{w}", np.array([w], np.int64)), axis=0))
        for w in sorted({n * attention.head_dim for n in heads})
    }
    live = op("Slice", positions, shared["zero_1d"], shared["seq_1d"], axis1)  # [rows, seq]
    placed = op("ScatterND", op("Expand", constant("zero_1d_i", np.zeros(1, np.int64)), grid), op_index, live)
    positions = op("Max", placed, zero)  # [rows, query]; holes and padding rotate as position 0 (unread)
    query = op("Squeeze", query_1d, axis0)
    steps = op("Range", zero, query, one)  # [query]
    first = op("Slice", positions, shared["zero_1d"], axis1, axis1)  # [rows, 1]
    on_chain = op("Equal", op("Sub", positions, first), steps)  # [rows, query]
    before = op("Less", op("Unsqueeze", positions, axis1), op("Unsqueeze", positions, axis2))  # [rows, s, t]
    itself = op("Equal", op("Unsqueeze", steps, axis1), op("Unsqueeze", steps, axis0))  # [s, t]
    sees = op("Or", op("And", op("Unsqueeze", on_chain, axis1), before), itself)  # [rows, s, t]: of the row's slots
    total = op("Cast", shared["total_sequence_length"], to=ir.DataType.INT64)
    offset = op("Sub", op("Unsqueeze", op("Range", zero, total, one), axis0), first)  # [rows, total]: slot - p
    own = op("And", op("GreaterOrEqual", offset, zero), op("Less", offset, query))  # the row's own slots
    index = op("Max", op("Min", offset, op("Sub", query, one)), zero)
    shape = op("Concat", op("Shape", sees, end=2), op("Unsqueeze", total, axis0), axis=0)  # [rows, query, total]
    seen = op("GatherElements", sees, op("Expand", op("Unsqueeze", index, axis1), shape), axis=2)
    hidden = op("And", op("Unsqueeze", own, axis1), op("Not", seen))
    minus_inf = constant("minus_inf", np.array(-np.inf, np.float32))
    bias = op("Where", hidden, minus_inf, constant("zero_f", np.array(0, np.float32)))
    bias = op("Unsqueeze", bias, axis1)  # [rows, 1, query, total]
    graph.extend(nodes)
    return {"op_index": op_index, "op_zeros": op_zeros, "op_positions": positions, "tree_bias": bias}
