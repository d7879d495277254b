"""qspec.onnx_files: weights linked once, read and saved by file name, on a one-MatMul graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qspec.errors import PackageError
from qspec.onnx_files import link_or_copy, load_model, save_model


def write_graph(folder, location="w.data"):
    """``folder/m.onnx``: y = x @ w, w [8, 8] in ``location``."""
    folder.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(folder / "m.onnx"), save_as_external_data=True, location=location, size_threshold=0)
    return folder / "m.onnx"


def test_a_linked_package_is_read_where_onnx_ir_refuses(tmp_path):
    """Linked weights: one inode for both folders, ONNX Runtime and load_model read them, onnx_ir.load's
    reader refuses them (why load_model exists)."""
    source = write_graph(tmp_path / "export")
    package = tmp_path / "package"
    package.mkdir()
    link_or_copy(source, package / "m.onnx")
    link_or_copy(source.with_name("w.data"), package / "w.data")
    assert (package / "w.data").stat().st_ino == source.with_name("w.data").stat().st_ino
    assert (package / "w.data").stat().st_nlink == 2
    with pytest.raises(ValueError, match="hard link"):
        ir.load(str(package / "m.onnx")).graph.initializers["w"].const_value.numpy()
    weight = load_model(package / "m.onnx").graph.initializers["w"].const_value.numpy()
    np.testing.assert_array_equal(weight, np.arange(64, dtype=np.float32).reshape(8, 8))
    session = ort.InferenceSession(str(package / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": np.ones((1, 8), np.float32)})[0][0], weight.sum(0))


def test_weights_outside_the_graphs_folder_are_refused(tmp_path):
    """A graph whose data file is outside its folder is refused in one line."""
    write_graph(tmp_path / "outside")
    path = write_graph(tmp_path / "graph")
    proto = onnx.load(str(path), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../outside/w.data"
    onnx.save(proto, str(path))
    with pytest.raises(PackageError, match="outside its folder"):
        load_model(path)


def test_a_saved_graph_names_its_data_by_file_name(tmp_path):
    """A graph loaded from one folder and saved in another refers to its weights by file name: it runs
    once the data file is beside it."""
    source = write_graph(tmp_path / "export")
    target = tmp_path / "package" / "m.onnx"
    target.parent.mkdir()
    save_model(load_model(source), target)
    tensor = onnx.load(str(target), load_external_data=False).graph.initializer[0]
    entries = {entry.key: entry.value for entry in tensor.external_data}
    assert entries["location"] == "w.data"
    link_or_copy(source.with_name("w.data"), target.with_name("w.data"))
    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.ones((1, 8), np.float32)})[0].shape == (1, 8)
