"""Fold a draft head's ``fc`` into a target graph exported with taps: ``tap.{i}`` outputs become one
``hidden_states = cat(tap.a, tap.b, ...) @ fc.T`` output ``[batch_size, seq_len, H]``, the feature an EAGLE-3 head
reads (vLLM's ``combine_hidden_states``), so every head kind reads the same package output.

Works on the vendor graph (``model.onnx``) and the runtime graph (``model.ort.onnx``) alike: the graph is read
without its external data, gets two nodes and ``fc`` as an inline initializer, and is written back beside its
data file (which it still names). Nothing the logits read changes.

Example: taps ``(2, 4, 5)`` of a 64-wide model, ``fc`` [64, 192]::

    tap.2, tap.4, tap.5 ─► Concat(axis=-1) [b, s, 192] ─► MatMul(taps.fc.weight [192, 64]) ─► hidden_states
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from qspec import contract
from qspec.errors import ConfigError
from qspec.export.graph import TAP_PREFIX, tap_name

FC_WEIGHT = "taps.fc.weight"  # [n * H, H]: the head's fc, held input-major as every MatMul weight of the graph


def graph_taps(path: Path) -> tuple[int, ...]:
    """The layer ids of the ``tap.{i}`` outputs of a saved graph, ascending."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return _tap_ids(proto.graph)


def _tap_ids(graph) -> tuple[int, ...]:
    return tuple(sorted(int(o.name.removeprefix(TAP_PREFIX)) for o in graph.output if o.name.startswith(TAP_PREFIX)))


def fold_taps(path: Path, layer_ids: tuple[int, ...], fc: np.ndarray) -> None:
    """Replace the ``tap.{i}`` outputs of the graph at ``path`` by ``hidden_states = cat(taps) @ fc.T``, in place
    (a new file: ``path`` may be a hard link into a cache). ``fc``: float32 ``[H, len(layer_ids) * H]``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    present = _tap_ids(graph)
    if present != tuple(layer_ids):
        raise ConfigError(f"{path.name} taps layers {list(present)}, the head reads {list(layer_ids)}; recompile")
    names = [tap_name(i) for i in layer_ids]
    first = next(o for o in graph.output if o.name == names[0])
    hidden = first.type.tensor_type.shape.dim[-1].dim_value
    if fc.shape != (hidden, len(names) * hidden):
        raise ConfigError(f"the head's fc is {list(fc.shape)}, the taps need [{hidden}, {len(names) * hidden}]")
    weight = numpy_helper.from_array(np.ascontiguousarray(fc.T, dtype=np.float32), FC_WEIGHT)
    graph.initializer.append(weight)
    concat = helper.make_node("Concat", names, ["taps.concat"], axis=-1, name="taps.concat")
    matmul = helper.make_node("MatMul", ["taps.concat", FC_WEIGHT], [contract.HIDDEN_STATES], name="taps.fc")
    graph.node.extend([concat, matmul])
    dims = [d.dim_param or d.dim_value for d in first.type.tensor_type.shape.dim]
    out = helper.make_tensor_value_info(contract.HIDDEN_STATES, TensorProto.FLOAT, dims)
    kept = [o for o in graph.output if not o.name.startswith(TAP_PREFIX)]
    at = next(i for i, o in enumerate(kept) if o.name == contract.LOGITS) + 1
    kept.insert(at, out)
    del graph.output[:]
    graph.output.extend(kept)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(proto, str(tmp))
    os.replace(tmp, path)
