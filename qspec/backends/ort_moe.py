"""ONNX Runtime's ``MoE`` operator in the runtime graph: each static mixture-of-experts block becomes one node.

The vendor graph runs every expert on every token (:mod:`qspec.export.moe`, QEfficient's static form: two MatMuls
over the experts' stacked weights, weighed by a dense routing table). ONNX Runtime's ``com.microsoft.MoE`` runs
only each token's top-k experts, so the runtime graph replaces each block the operator routes as the model does
(:class:`~qspec.package.MoEInfo`: softmax over the experts, top-k, the k weights renormalised or not; Mixtral and
Qwen3-MoE) by::

    MatMul(x, gate)  ->  Reshape [tokens, experts]  ->  MoE(x, logits, fc1, fc2)

with the weights laid out as ONNX Runtime GenAI's model builder lays them out: ``fc1`` ``[experts, 2 * inter,
hidden]``, each expert's gate and up rows interleaved (``swiglu_fusion=1``, the only SwiGLU layout the CPU kernel
takes), ``fc2`` ``[experts, hidden, inter]``; ``activation_type="swiglu"`` with alpha 1 and beta 0 is
``silu(gate) * up``. The router's logits stay a plain MatMul (quantized with the other MatMuls in int8/int4).

int8/int4 graphs get ``com.microsoft.QMoE`` (its CPU kernel takes block-wise int4 and int8 weights): each expert's
weights block-quantized by ONNX Runtime's block quantizer as a ``MatMulNBits`` weight would be (same blocks along
K, symmetric, same accuracy level), the bytes in the raw ``[experts, N, K * bits / 8]`` layout
(``weights_prepacked=0``). An asymmetric recipe keeps the plain form (its zero points are not carried over).

DeepSeek-V3's group-limited sigmoid routing (correction bias, ``topk_group`` of ``n_group`` groups, weights
renormalised and scaled) is not the operator's; its blocks (``MoEInfo.routing == "table"``) keep the graph's own
routing table ``[batch, seq, experts]`` (the chosen experts' weights, exact zeros elsewhere) and hand it over:
``QMoE`` takes it twice, as ``router_probs`` (its top-k picks the table's nonzero entries) and as
``router_weights`` (the mixing weights, as they are; ``normalize_routing_weights=0``). ``MoE`` has no
``router_weights`` input (ONNX Runtime 1.32's schema: 5 to 8 inputs), so the fp32 graph hands it the table's log
(``Log(Max(table, 1e-30))``: its softmax over the experts is ``table / sum(table)``, its top-k the chosen experts)
and multiplies its output by ``sum(table)``, which gives back the table's weights. The shared experts stay
MatMuls beside the node.
"""

from __future__ import annotations

import contextlib

from qspec.package import MoEInfo

MS_DOMAIN = "com.microsoft"
FUSION = "moe"  # RuntimeGraph.fusions key: blocks replaced by MoE / QMoE


def fuse_moe(model, info: MoEInfo, *, bits: int | None = None, settings: tuple = (32, 0, True)) -> int:
    """Replace each MoE block of ``info.layers`` in an ``onnx_ir`` model by one ``MoE`` node (``bits`` None) or
    one ``QMoE`` node (``bits`` 4 or 8; ``settings`` = (block size, accuracy level, symmetric), the MatMul
    quantizer's); returns how many. None with an asymmetric ``settings`` (the plain form stays).

    Example: Mixtral with 2 layers -> 2; the vendor graph's router Softmax, TopK and the stacked-expert MatMuls
    of both blocks are gone. DeepSeek-V3 (routing ``"table"``): its routing (sigmoid, TopKs) stays, the stacked-
    expert MatMuls are gone.
    """
    from onnxscript import optimizer

    block_size, _, symmetric = settings
    if bits is not None and not symmetric:
        return 0
    count = 0
    for layer in info.layers:
        block = _find_block(model, layer, info.routing)
        if block is None:
            continue
        up_matmul, down_matmul, logits = block
        experts = info.num_experts
        inter = down_matmul.inputs[1].const_value.shape[0] // experts
        hidden = up_matmul.inputs[1].const_value.shape[0]
        if bits is not None and (hidden % block_size or inter % block_size):
            continue  # the kernel wants whole blocks along both K
        _replace(model, layer, block, info, bits, settings)
        count += 1
    if count:
        optimizer.remove_unused_nodes(model)
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return count


def _find_block(model, layer: int, routing: str):
    """(up MatMul, down MatMul, routing value) of layer ``layer``'s static MoE block, or None: the router's logits
    (``routing`` ``"softmax"``) or the routing table (``"table"``).

    The block reads ``model.layers.{i}.mlp.experts.up_stacked`` and ``.down_stacked`` (MatMul weights) and the
    router ``model.layers.{i}.mlp.gate.weight`` through ``MatMul(x, Transpose(gate))``, x the block's input; the
    table is spread over the experts' activations by a ``Gather`` on its last axis, multiplied into the down
    MatMul's input (:func:`qspec.export.moe.static_moe`).
    """
    prefix = f"model.layers.{layer}.mlp."
    inits = model.graph.initializers
    names = (prefix + "experts.up_stacked", prefix + "experts.down_stacked", prefix + "gate.weight")
    if not all(name in inits for name in names):
        return None
    up_matmul, down_matmul = (_only_matmul(inits[name]) for name in names[:2])
    if up_matmul is None or down_matmul is None:
        return None
    if routing == "table":
        table = _spread_table(down_matmul)
        return None if table is None else (up_matmul, down_matmul, table)
    x = up_matmul.inputs[0]
    for transpose, _ in inits[names[2]].uses():
        if transpose.op_type != "Transpose":
            continue
        for router, index in transpose.outputs[0].uses():
            if router.op_type == "MatMul" and index == 1 and router.inputs[0] is x:
                return up_matmul, down_matmul, router.outputs[0]
    return None


def _spread_table(down_matmul):
    """The routing table ``[batch, seq, experts]`` that ``Mul(activations, Gather(table, spread, axis=-1))``
    weighs the down MatMul's input by, or None."""
    weighed = down_matmul.inputs[0].producer()
    if weighed is None or weighed.op_type != "Mul":
        return None
    for value in weighed.inputs:
        spread = value.producer()
        if spread is not None and spread.op_type == "Gather" and spread.attributes.get_int("axis", 0) in (-1, 2):
            return spread.inputs[0]
    return None


def _only_matmul(weight):
    users = list(weight.uses())
    if len(users) != 1 or users[0][0].op_type != "MatMul" or users[0][1] != 1:
        return None
    return users[0][0]


def _replace(model, layer: int, block, info: MoEInfo, bits: int | None, settings: tuple) -> None:
    import numpy as np
    import onnx_ir as ir

    up_matmul, down_matmul, routing = block
    graph = model.graph
    name = f"model.layers.{layer}.mlp.moe"
    shape = _initializer(graph, ir.tensor(np.array([-1, info.num_experts], np.int64), name=name + ".router_shape"))
    flat = ir.node("Reshape", [routing, shape], name=name + ".router_reshape")
    weights = _expert_weights(graph, name, up_matmul.inputs[1], down_matmul.inputs[1], info.num_experts, bits, settings)
    table = info.routing == "table"
    attributes = dict(
        k=info.top_k,
        activation_type="swiglu",
        swiglu_fusion=1,
        activation_alpha=1.0,
        activation_beta=0.0,
        normalize_routing_weights=0 if table else int(info.normalize),
    )
    if bits is not None:
        block_size, accuracy_level, _ = settings
        attributes |= dict(expert_weight_bits=bits, block_size=block_size, weights_prepacked=0)
        if accuracy_level:
            attributes["accuracy_level"] = accuracy_level
    nodes, probs, after = [flat], flat.outputs[0], []
    if table and bits is None:
        nodes, probs, after = _log_table(graph, name, flat, routing)
    elif table:
        weights = [*weights, *[None] * 7, flat.outputs[0]]  # router_weights: input 14, after the zero points
    op = "MoE" if bits is None else "QMoE"
    moe = ir.node(op, [up_matmul.inputs[0], probs, *weights], attributes=attributes, domain=MS_DOMAIN, name=name)
    result = moe
    if after:  # the MoE output times the table's sum
        result = ir.node("Mul", [moe.outputs[0], after[-1].outputs[0]], name=name + ".rescale")
    graph.insert_before(down_matmul, [*nodes, moe, *after, *([result] if after else [])])
    out = down_matmul.outputs[0]
    kept_name, kept_shape, kept_type = out.name, out.shape, out.type
    out.replace_all_uses_with(result.outputs[0], replace_graph_outputs=True)
    graph.remove(down_matmul, safe=True)
    result.outputs[0].name, result.outputs[0].shape, result.outputs[0].type = kept_name, kept_shape, kept_type


def _log_table(graph, name: str, flat, table):
    """(nodes before the ``MoE`` node, its ``router_probs``, nodes after it) for a routing table handed to ``MoE``
    (no ``router_weights`` input): ``Log(Max(table, 1e-30))``, whose softmax over the experts is ``table /
    sum(table)`` (the floor keeps a row of zeros finite), and ``ReduceSum(table)`` ``[batch, seq, 1]``, the factor
    that gives the table's weights back.

    Example: table row ``[0, 0.5, 0, 2.0]``: softmax of its log ``[0, 0.2, 0, 0.8]``, top-2 experts 3 and 1, output
    ``2.5 * (0.8 y3 + 0.2 y1) = 2.0 y3 + 0.5 y1``.
    """
    import numpy as np
    import onnx_ir as ir

    floor = _initializer(graph, ir.tensor(np.array(1e-30, np.float32), name=name + ".router_floor"))
    axes = _initializer(graph, ir.tensor(np.array([-1], np.int64), name=name + ".router_axes"))
    kept = ir.node("Max", [flat.outputs[0], floor], name=name + ".router_floor_max")
    log = ir.node("Log", [kept.outputs[0]], name=name + ".router_log")
    total = ir.node("ReduceSum", [table, axes], attributes=dict(keepdims=1), name=name + ".router_sum")
    return [flat, kept, log], log.outputs[0], [total]


def _expert_weights(graph, name: str, up_stacked, down_stacked, experts: int, bits: int | None, settings: tuple):
    """The operator's weight inputs (``None`` for an absent optional one), lazily computed from the stacked
    weights: ``MoE`` ``[fc1, -, fc2]``; ``QMoE`` ``[fc1, fc1 scales, -, fc2, fc2 scales]``."""
    import onnx_ir as ir

    hidden = up_stacked.const_value.shape[0]
    inter = down_stacked.const_value.shape[0] // experts
    sources = (up_stacked.const_value, down_stacked.const_value)

    def fc1():
        return interleaved_fc1(_read(sources[0]), experts)

    def fc2():
        return stacked_fc2(_read(sources[1]), experts)

    if bits is None:
        return [
            _lazy(graph, name + ".fc1", fc1, ir.DataType.FLOAT, [experts, 2 * inter, hidden]),
            None,
            _lazy(graph, name + ".fc2", fc2, ir.DataType.FLOAT, [experts, hidden, inter]),
        ]
    block_size = settings[0]
    quantized = _OneEntryCache()

    def part(make, index: int):
        return lambda: quantized.get(make, lambda: quantize_experts(make(), bits, settings))[index]

    values = []
    for label, make, n, k in (("fc1", fc1, 2 * inter, hidden), ("fc2", fc2, hidden, inter)):
        values += [
            _lazy(graph, f"{name}.{label}_Q{bits}", part(make, 0), ir.DataType.UINT8, [experts, n, k * bits // 8]),
            _lazy(graph, f"{name}.{label}_scales", part(make, 1), ir.DataType.FLOAT, [experts, n, k // block_size]),
            None,
        ]
    return values[:-1]


def interleaved_fc1(up_stacked, experts: int):
    """``[hidden, 2 * experts * inter]`` (every expert's gate columns, then every expert's up columns) ->
    ``[experts, 2 * inter, hidden]`` with each expert's gate and up rows interleaved.

    Example, 1 expert of width 2: columns ``[g0 g1 u0 u1]`` -> rows ``[g0 u0 g1 u1]``.
    """
    import numpy as np

    hidden = up_stacked.shape[0]
    gate_up = up_stacked.T.reshape(2, experts, -1, hidden)  # [gate/up, experts, inter, hidden]
    return np.ascontiguousarray(gate_up.transpose(1, 2, 0, 3).reshape(experts, -1, hidden))


def stacked_fc2(down_stacked, experts: int):
    """``[experts * inter, hidden]`` (the experts' down projections one under the other) ->
    ``[experts, hidden, inter]``."""
    import numpy as np

    hidden = down_stacked.shape[1]
    return np.ascontiguousarray(down_stacked.reshape(experts, -1, hidden).transpose(0, 2, 1))


def quantize_experts(weights, bits: int, settings: tuple):
    """``weights`` ``[experts, N, K]`` -> (bytes ``[experts, N, K * bits / 8]``, scales ``[experts, N, K /
    block]``): each expert's ``[K, N]`` weight through ONNX Runtime's block quantizer, as ``MatMulNBits``
    stores it (its ``[N, blocks, block bytes]`` is the raw row layout QMoE reads)."""
    import numpy as np
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    block_size, accuracy_level, symmetric = settings
    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level, bits=bits
    )
    quantizer = DefaultWeightOnlyQuantizer(config)
    experts, n, k = weights.shape
    packed, scales = [], []
    for expert in weights:
        q, s, _ = quantizer.qbits_block_quant(np.ascontiguousarray(expert.T))
        packed.append(q.reshape(n, k * bits // 8))
        scales.append(s.reshape(n, k // block_size))
    return np.stack(packed), np.stack(scales).astype(np.float32)


class _OneEntryCache:
    """The last computed result, by its maker: a layer's quantized bytes and scales are written one after the
    other, and quantized once."""

    def __init__(self):
        self.key, self.value = None, None

    def get(self, key, compute):
        if self.key is not key:
            self.key, self.value = key, compute()
        return self.value


def _read(tensor):
    import numpy as np
    import onnx_ir as ir

    array = np.array(tensor.numpy())  # a copy: the mapped vendor file is released below
    if isinstance(tensor, ir.ExternalTensor):
        with contextlib.suppress(BufferError):
            tensor.release()
    return array


def _lazy(graph, name: str, make, dtype, dims: list[int]):
    import onnx_ir as ir

    tensor = ir.LazyTensor(lambda: ir.tensor(make(), name=name), dtype=dtype, shape=ir.Shape(dims), name=name)
    return _initializer(graph, tensor)


def _initializer(graph, tensor):
    import onnx_ir as ir

    value = ir.Value(name=tensor.name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value
