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
RoPE table of ``ctx_len`` plus that slack rows. Medusa heads have neither attention nor norms: their
runtime graph is the vendor graph (quantized for int8/int4).

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
    from qspec.backends.ort_attention import fuse_attention
    from qspec.backends.ort_optimize import drop_unused_functions, fuse

    fusions = fuse(model)
    fusions["group_query_attention"] = fuse_attention(
        model, attention, rope_positions, pack_qkv=True, layer_prefix=EAGLE_LAYER_PREFIX
    )
    drop_unused_functions(model)  # the vendor attention's CtxScatter/CtxGather
    return fusions


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
    export.save(model, path)
    return quantized
