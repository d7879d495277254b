"""The draft head's ONNX Runtime graph, ``head.ort.onnx``: its vendor graph with the target's fused ops.

The vendor graph ``head.onnx`` is the contract (the ``qaic`` backend compiles it) and stays as traced.
For ONNX Runtime an EAGLE head gets the rewrite the target's runtime graph gets
(:mod:`qspec.backends.ort_optimize`), applied to its one decoder layer:

- its post-attention residual Add + RMSNorm becomes ``SkipSimplifiedLayerNormalization``
  (:func:`qspec.backends.ort_optimize.fuse`);
- its attention (RoPE, the KV write at ``position_ids``, a mask over the whole buffer, softmax) becomes
  one ``GroupQueryAttention`` with packed q/k/v (:func:`qspec.backends.ort_attention.fuse_attention`,
  which states how the contract's positions, padding and ``batch_index`` map onto the op). A call then
  reads the KV slots up to its positions instead of the whole buffer.

What the op needs that the vendor graph does not: KV buffers :func:`~qspec.package.attention_slack`
slots longer than ``ctx_len`` (``HeadManifest.kv_slack``; live positions stay below ``ctx_len``) and a
RoPE table of ``ctx_len`` plus that slack rows.

A head without ``batch_index`` (a one-slot package's) also takes the host's call plan
(:mod:`qspec.backends.ort_plan`, rows not cut): attention's ``seqlens_k``, query lengths and total, and
each row's last live slot, whose feature the graph returns (``hidden_states_out``) and the LM head reads
(in the graph, about thirty small nodes a call). Its attention runs a lone query: the exactness pad is the
target's concern, a draft is verified whatever its rounding.

Medusa heads have neither attention nor norms: their runtime graph is the vendor graph (quantized for int8/int4).

Weights follow as for the vendor graph: int8/int4 MatMul weights become ``MatMulNBits``
(:func:`qspec.heads.export.quantize_copy`), then every large float initializer is stored as float16
(:func:`qspec.heads.export.store_float16`), so the fused and the vendor graph compute with the same
weights.
"""

from __future__ import annotations

from pathlib import Path

# Where the traced EAGLE graph holds layer i's attention (EagleKVExplicit's `lm`, a KVExplicitLM).
EAGLE_LAYER_PREFIX = "lm.layers.{i}.self_attn."
BITS = {"int8": 8, "int4": 4}


def copy_model(model):
    """An independent copy of an ``onnx_ir`` model (its weights included)."""
    import onnx_ir as ir

    return ir.from_proto(ir.to_proto(model))


def fuse_eagle(model, attention, *, rope_positions: int) -> dict[str, int]:
    """RMSNorm fusions and ``GroupQueryAttention`` on a traced EAGLE graph, in place; the count of each."""
    from qspec import contract
    from qspec.backends.ort_attention import fuse_attention
    from qspec.backends.ort_optimize import drop_unused_functions, fuse

    fusions = fuse(model)
    one_slot = contract.BATCH_INDEX not in {value.name for value in model.graph.inputs}
    fusions["group_query_attention"] = fuse_attention(
        model,
        attention,
        rope_positions,
        pack_qkv=True,
        host_plan=one_slot,
        lone_query=one_slot,
        layer_prefix=EAGLE_LAYER_PREFIX,
    )
    if one_slot:
        fusions["planned_last_rows"] = _planned_last_rows(model)
    drop_unused_functions(model)  # the vendor attention's CtxScatter/CtxGather
    return fusions


def _planned_last_rows(model) -> int:
    """``hidden_states_out`` (and the logits of it), each row's last live rows, read at the plan's kept slots
    (``GatherND``; one a chained call, K a parallel head's) instead of the slot the traced graph computes from
    ``position_ids``; 1."""
    import onnx_ir as ir
    from onnxscript import optimizer

    from qspec import contract
    from qspec.backends import ort_plan

    graph = model.graph
    out = next(value for value in graph.outputs if value.name == contract.HIDDEN_STATES_OUT)
    picked = out.producer()
    if picked is None or picked.op_type != "GatherElements":
        raise ValueError(f"the head's {contract.HIDDEN_STATES_OUT} is not a GatherElements of its rows")
    slots = next(value for value in graph.inputs if value.name == ort_plan.KEPT_SLOTS)
    node = ir.node("GatherND", [picked.inputs[0], slots], attributes={"batch_dims": 1}, name="last_rows")
    graph.insert_before(picked, node)
    index = next(i for i, value in enumerate(graph.outputs) if value is out)
    for user, at in list(out.uses()):
        user.replace_input_with(at, node.outputs[0])
    node.outputs[0].name, node.outputs[0].type = out.name, out.type
    out.name = None
    graph.outputs[index] = node.outputs[0]
    for value in graph.outputs:  # [rows, kept rows, width]: one row a chained call, K a parallel one
        if value.name in (contract.HIDDEN_STATES_OUT, contract.LOGITS) and value.shape is not None:
            value.shape = ir.Shape([value.shape[0], ort_plan.KEPT_ROWS, value.shape[2]])
    optimizer.remove_unused_nodes(model)
    return 1


def write_runtime_graph(model, path: Path, *, weight_format: str) -> int:
    """Quantize ``model`` (int8/int4), store its large float weights as float16 and write it to ``path``;
    returns how many MatMuls were quantized. ``model`` is changed: pass a copy (:func:`copy_model`)."""
    from qspec.backends.ort_optimize import omit_unused_statistics
    from qspec.heads import export

    quantized = 0
    if weight_format in BITS:
        model, quantized = export.quantize_copy(model, BITS[weight_format])
    export.store_float16(model)
    omit_unused_statistics(model)
    export.save(model, path, check=False)  # check_head_sessions runs it in ONNX Runtime
    return quantized
