"""The KV cache's write and read as PyTorch ops that trace to QEfficient's ``CtxScatter`` / ``CtxGather`` nodes.

QEfficient's graphs, the ones the vendor compiler is known to lower, write the KV of a call at its
positions and read it back through four ONNX functions of the ``com.qualcomm.cloud`` domain:

========================================================  ==================================================
``CtxScatter(data, position_ids, updates)``               ``data[b, h, position_ids[b, s]] = updates[b, h, s]``
``CtxScatterCB(data, batch_index, position_ids, updates)`` the same into KV row ``batch_index[b, 0]``
``CtxGather(data, ctx_indices, comp_ctx_len)``            ``data[b, h, ctx_indices[b, 0, j]]``, ``j < comp_ctx_len``
``CtxGatherCB(data, batch_index, ctx_indices, comp_ctx_len)`` the same from KV row ``batch_index[b, 0]``
========================================================  ==================================================

``data`` is a ``[rows, kv_heads, ctx_len, head_dim]`` buffer, ``position_ids`` ``[batch, seq_len]``,
``updates`` ``[batch, kv_heads, seq_len, head_dim]``, ``ctx_indices`` ``[batch, 1, n]``. Each op here is
a ``torch.library`` custom op: eagerly it computes the function's result (the wrapper's PyTorch forward
and the parity tests use it), and the exporter turns each call into one node of the function
(:mod:`qspec.export.ctx_functions` holds the ONNX side: the bodies and the translation).

Every index must lie in ``[0, ctx_len)``: ONNX Runtime rejects out-of-range indices (see
:mod:`qspec.export.ctx_functions`), so the wrapper never sends one.
"""

from __future__ import annotations

import torch

NAMESPACE = "qspec"


def _rows_heads(data: torch.Tensor, rows: torch.Tensor | None):
    """Index tensors ``[batch, 1, 1]`` and ``[1, kv_heads, 1]`` that broadcast against ``[batch, 1, n]``."""
    batch = torch.arange(data.shape[0]).view(-1, 1, 1) if rows is None else rows.view(-1, 1, 1)
    return batch, torch.arange(data.shape[1]).view(1, -1, 1)


@torch.library.custom_op(f"{NAMESPACE}::ctx_scatter", mutates_args=())
def ctx_scatter(data: torch.Tensor, position_ids: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """``data`` with ``updates[b, :, s]`` written at slot ``position_ids[b, s]`` of row ``b``."""
    out = data.clone()
    batch, heads = _rows_heads(data, None)
    out[batch, heads, position_ids.unsqueeze(1)] = updates
    return out


@ctx_scatter.register_fake
def _(data, position_ids, updates):
    return torch.empty_like(data)


@torch.library.custom_op(f"{NAMESPACE}::ctx_scatter_cb", mutates_args=())
def ctx_scatter_cb(
    data: torch.Tensor, batch_index: torch.Tensor, position_ids: torch.Tensor, updates: torch.Tensor
) -> torch.Tensor:
    """``data`` with ``updates[b, :, s]`` written at slot ``position_ids[b, s]`` of KV row ``batch_index[b, 0]``."""
    out = data.clone()
    batch, heads = _rows_heads(data, batch_index)
    out[batch, heads, position_ids.unsqueeze(1)] = updates
    return out


@ctx_scatter_cb.register_fake
def _(data, batch_index, position_ids, updates):
    return torch.empty_like(data)


@torch.library.custom_op(f"{NAMESPACE}::ctx_gather", mutates_args=())
def ctx_gather(data: torch.Tensor, ctx_indices: torch.Tensor, comp_ctx_len: int) -> torch.Tensor:
    """``[batch, kv_heads, n, head_dim]``: slots ``ctx_indices[b, 0, :]`` of row ``b`` (``n == comp_ctx_len``)."""
    batch, heads = _rows_heads(data, None)
    return data[batch, heads, ctx_indices]


@ctx_gather.register_fake
def _(data, ctx_indices, comp_ctx_len):
    return data.new_empty(data.shape[0], data.shape[1], ctx_indices.shape[-1], data.shape[3])


@torch.library.custom_op(f"{NAMESPACE}::ctx_gather_cb", mutates_args=())
def ctx_gather_cb(
    data: torch.Tensor, batch_index: torch.Tensor, ctx_indices: torch.Tensor, comp_ctx_len: int
) -> torch.Tensor:
    """``[batch, kv_heads, n, head_dim]``: slots ``ctx_indices[b, 0, :]`` of KV row ``batch_index[b, 0]``."""
    batch, heads = _rows_heads(data, batch_index)
    return data[batch, heads, ctx_indices]


@ctx_gather_cb.register_fake
def _(data, batch_index, ctx_indices, comp_ctx_len):
    return data.new_empty(batch_index.shape[0], data.shape[1], ctx_indices.shape[-1], data.shape[3])
