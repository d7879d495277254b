"""The runtime graph's own weights file: what an optimized graph writes beside itself instead of reading the
export's (:func:`qspec.backends.ort_optimize.optimize_graph` calls both)."""

from __future__ import annotations

from pathlib import Path

from qspec.backends.ort_quantize import EXTERNAL_MIN_BYTES, PAGE_BYTES


def own_source_weights(model) -> int:
    """Make every weight the graph reads from the source's data file its own (read when written), so the
    graph's data file holds all its weights and a package need not ship the source's; returns how many.

    An fp32 graph whose MoE blocks are ONNX Runtime's ``MoE`` operator reads the experts in the operator's
    layout (its own data) and no longer the static form's stacked copy in the source's data file: shipping
    that file beside its own would hold every expert twice (Mixtral, hidden 256, 2 layers, 4 experts: a
    53.7 MB package, 27.5 MB without the source's file). The weights other than the experts are then copied
    once, into the graph's own file.
    """
    import onnx_ir as ir

    moved = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            value.const_value = ir.LazyTensor(
                lambda t=tensor: ir.Tensor(t.numpy(), name=t.name),
                dtype=tensor.dtype,
                shape=tensor.shape,
                name=tensor.name,
            )
            moved += 1
    return moved


def externalize_own_weights(model, data: Path) -> int:
    """Write the in-memory initializers of ``EXTERNAL_MIN_BYTES`` and more of an ``onnx_ir`` model to
    ``data``, each at a page boundary, and point the model at them; returns how many (none: no file)."""
    import onnx_ir as ir
    from onnx_ir.external_data import convert_tensors_to_external

    own = [
        value
        for value in model.graph.initializers.values()
        if value.const_value is not None
        and not isinstance(value.const_value, ir.ExternalTensor)
        and value.const_value.nbytes >= EXTERNAL_MIN_BYTES
    ]
    if own:
        external = convert_tensors_to_external(
            [value.const_value for value in own], data.parent, data.name, alignment=PAGE_BYTES, align_threshold=0
        )
        for value, tensor in zip(own, external):
            value.const_value = tensor
    return len(own)
