"""The ort backend's graph recipe: weights quantized one at a time exactly as the whole-graph quantizer does."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qspec.backends.ort_optimize import materialize_transposed_weights
from qspec.backends.ort_quantize import quantize_matmuls, quantize_streamed
from qspec.export import ExportOptions, export_model
from qspec.export.exporter import ONNX_FILE
from qspec.onnx_files import load_model


def _nbits(proto) -> dict[str, tuple]:
    """``{node name: (attributes, the arrays of its weight inputs)}`` of every MatMulNBits node."""
    arrays = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    return {
        node.name: (
            {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute},
            [arrays[n] for n in node.input[1:]],
        )
        for node in proto.graph.node
        if node.op_type == "MatMulNBits"
    }


@pytest.mark.parametrize("bits,tie", [(4, False), (8, True)])
def test_streamed_quantization_equals_the_whole_graph_quantizer(tiny_model, tmp_path, bits, tie):
    """ONNX Runtime's quantizer on each weight alone gives the nodes and tensors it gives on the whole graph,
    a tied head (a transposed view of the embedding, folded) included."""
    import onnx_ir as ir

    folder, _ = export_model(tiny_model("llama", tie=tie), ExportOptions())
    whole = load_model(folder / ONNX_FILE)  # the export may be linked into packages
    ir.external_data.load_to_model(whole)
    materialize_transposed_weights(whole)
    expected, count = quantize_matmuls(ir.to_proto(whole), bits)

    model = load_model(folder / ONNX_FILE)
    assert materialize_transposed_weights(model) == int(tie)
    assert quantize_streamed(model, bits, tmp_path / "q.onnx.data") == count > 0
    ir.save(model, str(tmp_path / "q.onnx"))
    assert all(
        v.const_value is None or v.const_value.nbytes < 1024 or isinstance(v.const_value, ir.ExternalTensor)
        for v in model.graph.initializers.values()
    )  # every weight went to q.onnx.data as it was made
    got, want = _nbits(onnx.load(str(tmp_path / "q.onnx"))), _nbits(expected)
    assert got.keys() == want.keys()
    for name, (attributes, arrays) in want.items():
        assert got[name][0] == attributes
        for a, b in zip(got[name][1], arrays, strict=True):
            np.testing.assert_array_equal(a, b)
