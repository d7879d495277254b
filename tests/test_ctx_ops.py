"""QEfficient's CtxScatter / CtxGather functions as qspec writes them: signatures, bodies on ONNX Runtime, torch ops."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from qspec.export import ctx_functions
from qspec.export.ctx_ops import ctx_gather, ctx_gather_cb, ctx_scatter, ctx_scatter_cb

# QEfficient/customop/ctx_scatter_gather.py and ctx_scatter_gather_cb.py at ebf55e8159c8: name -> parameters.
QEFFICIENT_SIGNATURES = {
    "CtxScatter": ["data", "position_ids", "updates"],
    "CtxScatterCB": ["data", "batch_index", "position_ids", "updates"],
    "CtxGather": ["data", "ctx_indices", "comp_ctx_len"],
    "CtxGatherCB": ["data", "batch_index", "ctx_indices", "comp_ctx_len"],
}
INT32_MAX = 2**31 - 1


def _session(name: str, feeds: dict[str, np.ndarray]) -> ort.InferenceSession:
    """A one-node model calling function ``name`` on ``feeds`` (all inputs), with the function's definition."""
    proto = ctx_functions.FUNCTIONS[name].to_function_proto()
    inputs = [
        helper.make_tensor_value_info(key, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
        for key, value in feeds.items()
    ]
    node = helper.make_node(name, list(feeds), ["out"], domain=ctx_functions.DOMAIN)
    graph = helper.make_graph(
        [node], "ctx", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, list("bhnd"))]
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ctx_functions.DOMAIN, 1)],
        functions=[proto],
    )
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run(name: str, **feeds: np.ndarray) -> np.ndarray:
    return _session(name, feeds).run(None, feeds)[0]


def _kv(rows: int, ctx: int = 6) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((rows, 2, ctx, 3)).astype(np.float32)  # [rows, heads, ctx, dim]


def test_functions_have_qefficients_names_domain_and_parameters():
    """The four functions carry QEfficient's names and parameter order, domain com.qualcomm.cloud v1, opset-18 body."""
    assert ctx_functions.DOMAIN == "com.qualcomm.cloud" and ctx_functions.VERSION == 1
    for name, params in QEFFICIENT_SIGNATURES.items():
        proto = ctx_functions.FUNCTIONS[name].to_function_proto()
        assert (proto.domain, proto.name, list(proto.input)) == ("com.qualcomm.cloud", name, params)
        assert len(proto.output) == 1 and proto.node  # a body
        assert {o.domain: o.version for o in proto.opset_import}[""] == 18


def test_scatter_functions_equal_the_torch_ops():
    """CtxScatter and CtxScatterCB on ONNX Runtime write what the eager ops write (CB: into KV rows batch_index)."""
    data, updates = _kv(3), np.arange(2 * 2 * 2 * 3, dtype=np.float32).reshape(2, 2, 2, 3)
    positions = np.array([[4, 5], [0, 1]], dtype=np.int64)
    batch_index = np.array([[2], [0]], dtype=np.int64)
    want = ctx_scatter(torch.from_numpy(data[:2]), torch.from_numpy(positions), torch.from_numpy(updates)).numpy()
    got = _run("CtxScatter", data=data[:2], position_ids=positions, updates=updates)
    np.testing.assert_array_equal(got, want)
    assert (got[0, :, 4:6] == updates[0]).all() and (got[1, :, 2:] == data[1, :, 2:]).all()
    want = ctx_scatter_cb(*(torch.from_numpy(a) for a in (data, batch_index, positions, updates))).numpy()
    got = _run("CtxScatterCB", data=data, batch_index=batch_index, position_ids=positions, updates=updates)
    np.testing.assert_array_equal(got, want)
    assert (got[2, :, 4:6] == updates[0]).all() and (got[1] == data[1]).all()  # KV row 1 untouched


def test_gather_functions_equal_the_torch_ops():
    """CtxGather and CtxGatherCB read slots ctx_indices[b, 0, :] (comp_ctx_len of them) of each row."""
    data = _kv(3)
    indices = np.array([[[0, 1, 2, 0]], [[3, 0, 0, 0]]], dtype=np.int64)  # [batch, 1, n]: n = 4 < ctx 6 (a CCL)
    length = np.array(4, dtype=np.int64)
    want = ctx_gather(torch.from_numpy(data[:2]), torch.from_numpy(indices), 4).numpy()
    got = _run("CtxGather", data=data[:2], ctx_indices=indices, comp_ctx_len=length)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[1, :, 0], data[1, :, 3])
    batch_index = np.array([[2], [1]], dtype=np.int64)
    want = ctx_gather_cb(torch.from_numpy(data), torch.from_numpy(batch_index), torch.from_numpy(indices), 4).numpy()
    got = _run("CtxGatherCB", data=data, batch_index=batch_index, ctx_indices=indices, comp_ctx_len=length)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0, :, 1], data[2, :, 1])


@pytest.mark.parametrize("name", ["CtxScatterCB", "CtxGather"])
def test_qefficients_out_of_range_padding_index_fails_on_onnx_runtime(name):
    """QEfficient's INT32_MAX index (a padding write the device drops, an invalid slot's read) is rejected by
    ONNX Runtime: the reason qspec rewrites a padding slot's own value and reads invalid slots at 0."""
    data = _kv(2)
    if name == "CtxScatterCB":
        feeds = {
            "data": data,
            "batch_index": np.array([[0]], dtype=np.int64),
            "position_ids": np.array([[1, INT32_MAX]], dtype=np.int64),
            "updates": np.zeros((1, 2, 2, 3), np.float32),
        }
    else:
        feeds = {
            "data": data,
            "ctx_indices": np.array([[[0, INT32_MAX]], [[0, 1]]], dtype=np.int64),
            "comp_ctx_len": np.array(2, dtype=np.int64),
        }
    with pytest.raises(Exception, match="invalid ind"):
        _run(name, **feeds)
