"""The node builders of :func:`qspec.backends.ort_attention.fuse_attention`: the packed q/k/v projection, the
KV reshapes (rows, slots), the padded query, the per-head and full q/k norms."""

from __future__ import annotations

import contextlib

import numpy as np

from qspec import contract
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
