"""The ONNX side of :mod:`qspec.export.ctx_ops`: QEfficient's ``CtxScatter`` / ``CtxGather`` functions, with bodies.

QEfficient (``QEfficient/customop/ctx_scatter_gather.py`` and ``ctx_scatter_gather_cb.py``, read at
commit ``ebf55e8``) defines these as ONNX functions of the ``com.qualcomm.cloud`` domain, version 1;
its exporter calls them from the graph and appends their ``FunctionProto``s to the model. qspec
writes the same functions (names, domain, parameter names and order, the same body ops) at opset 18,
the opset of QEfficient's ``torch.export`` path and of qspec's graph (the dynamo exporter converts
to no lower opset; QEfficient's TorchScript path is opset 17).

How the calls get into the graph: the wrapper calls the ops of :mod:`~qspec.export.ctx_ops`; the
exporter translates each call into one node of the domain (:func:`translation_table`: a node, not
the body, since the exporter's opset pass would inline a function it knew), and once the pieces are
chained and inlined, :func:`attach` adds the definitions the graph uses. ONNX Runtime inlines them
at load, so the vendor graph runs there as it is.

The one change to QEfficient's bodies: ``Range`` gets scalars (QEfficient passes it one-element
tensors, which ONNX Runtime's shape inference rejects once the shapes are static, as in a session of
one specialization).

One part of QEfficient's form does not run on ONNX Runtime: an index out of ``[0, ctx_len)``.
QEfficient sends a padding token's write to ``INT32_MAX`` under continuous batching (a slot the
device drops) and, without a decoder sub-function, reads invalid slots at ``INT32_MAX``; ONNX Runtime's
ScatterND and GatherND fail on such an index ("invalid indice found"). qspec never sends one:
padding writes back the value its slot holds (a no-op on every runtime) and invalid slots are read at
0 (QEfficient's own value under ``torch.export`` and with sub-functions), masked out by position.
"""

from __future__ import annotations

import onnxscript
from onnxscript import FLOAT, INT64
from onnxscript import opset18 as op

from qspec.export.graph import CTX_DOMAIN as DOMAIN

VERSION = 1
_QAIC = onnxscript.values.Opset(DOMAIN, VERSION)


@onnxscript.script(_QAIC, default_opset=op)
def CtxScatter(data: FLOAT, position_ids: INT64, updates: FLOAT) -> FLOAT:
    # indices[b, h, s] = (b, h, position_ids[b, s]): [batch, kv_heads, seq_len, 3]
    batch_size = op.Gather(op.Shape(data), [0])
    num_heads = op.Gather(op.Shape(data), [1])
    seq_len = op.Gather(op.Shape(position_ids), [1])
    one = op.Constant(value_ints=[1])
    exp_shape = op.Concat(batch_size, num_heads, seq_len, one, axis=0)
    batch_idx = op.Expand(op.Unsqueeze(op.Range(0, op.Squeeze(batch_size), 1), [1, 2, 3]), exp_shape)
    head_idx = op.Expand(op.Unsqueeze(op.Range(0, op.Squeeze(num_heads), 1), [0, 2, 3]), exp_shape)
    ctx_idx = op.Expand(op.Unsqueeze(position_ids, [1, 3]), exp_shape)
    indices = op.Concat(batch_idx, head_idx, ctx_idx, axis=3)
    return op.ScatterND(data, indices, updates)


@onnxscript.script(_QAIC, default_opset=op)
def CtxScatterCB(data: FLOAT, batch_index: INT64, position_ids: INT64, updates: FLOAT) -> FLOAT:
    # indices[b, h, s] = (batch_index[b, 0], h, position_ids[b, s])
    batch_size = op.Gather(op.Shape(batch_index), [0])
    num_heads = op.Gather(op.Shape(data), [1])
    seq_len = op.Gather(op.Shape(position_ids), [1])
    one = op.Constant(value_ints=[1])
    exp_shape = op.Concat(batch_size, num_heads, seq_len, one, axis=0)
    batch_idx = op.Expand(op.Unsqueeze(batch_index, [2, 3]), exp_shape)
    head_idx = op.Expand(op.Unsqueeze(op.Range(0, op.Squeeze(num_heads), 1), [0, 2, 3]), exp_shape)
    ctx_idx = op.Expand(op.Unsqueeze(position_ids, [1, 3]), exp_shape)
    indices = op.Concat(batch_idx, head_idx, ctx_idx, axis=3)
    return op.ScatterND(data, indices, updates)


@onnxscript.script(_QAIC, default_opset=op)
def CtxGather(data: FLOAT, ctx_indices: INT64, comp_ctx_len: INT64) -> FLOAT:
    # ctx_indices [batch, 1, n] -> [batch, kv_heads, comp_ctx_len, 1], rows and heads as batch dims
    shape_tensor = op.Concat(op.Shape(data, start=0, end=2), op.Reshape(comp_ctx_len, [1]), axis=0)
    ctx_indices = op.Expand(ctx_indices, shape_tensor)
    ctx_indices = op.Unsqueeze(ctx_indices, [-1])
    return op.GatherND(data, ctx_indices, batch_dims=2)


@onnxscript.script(_QAIC, default_opset=op)
def CtxGatherCB(data: FLOAT, batch_index: INT64, ctx_indices: INT64, comp_ctx_len: INT64) -> FLOAT:
    # indices[b, h, j] = (batch_index[b, 0], h, ctx_indices[b, 0, j]); the length is ctx_indices' (as QEfficient:
    # a shape-derived value, not the comp_ctx_len input, lowers on the compiler)
    batch_size = op.Gather(op.Shape(batch_index), [0])
    num_heads = op.Gather(op.Shape(data), [1])
    ctx_len = op.Gather(op.Shape(ctx_indices), [2])
    one = op.Constant(value_ints=[1])
    exp_shape = op.Concat(
        op.Reshape(batch_size, [1]), op.Reshape(num_heads, [1]), op.Reshape(ctx_len, [1]), one, axis=0
    )
    batch_idx = op.Expand(op.Unsqueeze(batch_index, [2, 3]), exp_shape)
    head_idx = op.Expand(op.Unsqueeze(op.Range(0, op.Squeeze(num_heads), 1), [0, 2, 3]), exp_shape)
    ctx_idx = op.Expand(op.Unsqueeze(ctx_indices, [3]), exp_shape)
    indices = op.Concat(batch_idx, head_idx, ctx_idx, axis=3)
    return op.GatherND(data, indices)


FUNCTIONS = {f.name: f for f in (CtxScatter, CtxScatterCB, CtxGather, CtxGatherCB)}


def _node_op(function: onnxscript.OnnxFunction) -> onnxscript.values.Op:
    """An op that records one call of ``function`` (a node of its domain), not its body."""
    import onnx

    param = onnx.defs.OpSchema.FormalParameter
    kv = ("data", "updates")
    schema = onnx.defs.OpSchema(
        function.name,
        DOMAIN,
        VERSION,
        inputs=[param(value.name, "T" if value.name in kv else "I") for value in function.function_ir.inputs],
        outputs=[param("output", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "KV values"),
            ("I", ["tensor(int64)"], "indices and lengths"),
        ],
    )
    return onnxscript.values.Op(_QAIC, function.name, schema)


def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export``: each op of :mod:`~qspec.export.ctx_ops` to one node."""
    import torch

    from qspec.export import ctx_ops  # noqa: F401  (registers the torch ops)

    scatter, scatter_cb, gather, gather_cb = (_node_op(FUNCTIONS[name]) for name in FUNCTIONS)

    def ctx_scatter(data: FLOAT, position_ids: INT64, updates: FLOAT) -> FLOAT:
        return scatter(data, position_ids, updates)

    def ctx_scatter_cb(data: FLOAT, batch_index: INT64, position_ids: INT64, updates: FLOAT) -> FLOAT:
        return scatter_cb(data, batch_index, position_ids, updates)

    def ctx_gather(data: FLOAT, ctx_indices: INT64, comp_ctx_len: INT64) -> FLOAT:
        return gather(data, ctx_indices, comp_ctx_len)

    def ctx_gather_cb(data: FLOAT, batch_index: INT64, ctx_indices: INT64, comp_ctx_len: INT64) -> FLOAT:
        return gather_cb(data, batch_index, ctx_indices, comp_ctx_len)

    ops = torch.ops.qspec
    return {
        ops.ctx_scatter.default: ctx_scatter,
        ops.ctx_scatter_cb.default: ctx_scatter_cb,
        ops.ctx_gather.default: ctx_gather,
        ops.ctx_gather_cb.default: ctx_gather_cb,
    }


def used_functions(graph) -> list[str]:
    """Names of the Ctx functions an ``onnx_ir`` graph calls, in order of first call."""
    names = [node.op_type for node in graph if node.domain == DOMAIN]
    return list(dict.fromkeys(names))


def attach(model) -> list[str]:
    """Add the definitions of the Ctx functions an ``onnx_ir`` model calls, and their domain; returns their names."""
    import onnx_ir as ir

    names = used_functions(model.graph)
    for name in names:
        function = ir.serde.deserialize_function(FUNCTIONS[name].to_function_proto())
        model.functions[function.identifier()] = function
    if names:
        model.opset_imports[DOMAIN] = VERSION
    return names
