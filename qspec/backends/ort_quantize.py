"""The ort backend's weight quantization: every MatMul with a constant 2-D weight becomes ``MatMulNBits``
(block-wise, symmetric), one weight at a time into the graph's own data file, and the embedding tables become
block-quantized ``GatherBlockQuantized`` lookups (:func:`quantize_streamed`; the recipe:
:mod:`qspec.backends.ort_optimize`). A GGUF source's blocks are carried over as they are where
``MatMulNBits`` holds them exactly (:mod:`qspec.backends.ort_gguf`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from qspec.backends.ort_gguf import BLOCK as GGUF_BLOCK
from qspec.backends.ort_gguf import GGUFBlocks

Progress = Callable[[str], None]

# MatMulNBits settings, chosen by measurement on the 2-core x86 machines (docs/measurements.md).
BITS: dict[str, int] = {"int8": 8, "int4": 4}
BLOCK_SIZE = 32
# 4: int8 activations (the fast x86 kernels); 0: the unset default (fp32 activations: on this CPU
# int4 and int8 calls are several times slower: there is no fast fp32-activation kernel).
INT8_ACTIVATIONS = 4
ACCURACY_LEVEL = INT8_ACTIVATIONS
# Symmetric blocks (a scale, no zero point), as ONNX Runtime GenAI's builder makes them: the int8-activation
# kernels skip the zero-point correction, faster than asymmetric blocks at the same agreement with fp32.
SYMMETRIC = True
# Initializers below this size stay inside the .onnx file.
EXTERNAL_MIN_BYTES = 1024
# The fp32 graph's own initializers go to its .data file, each at a page boundary (as ONNX Runtime
# writes the int8/int4 graphs' data).
PAGE_BYTES = 4096


def tied_tables(model) -> dict[str, str]:
    """``{LM head weight: embedding table}`` of a tied head, ``MatMul(x, Transpose(table))`` beside
    ``Gather(table, ids)``: the name the head's weight gets when :func:`materialize_transposed_weights` folds it."""
    gathered = {node.inputs[0].name for node in model.graph if _is_table_gather(node)}
    return {
        node.outputs[0].name: node.inputs[0].name
        for node in model.graph
        if node.op_type == "Transpose"
        and node.inputs[0] is not None
        and node.inputs[0].name in gathered
        and any(user.op_type == "MatMul" for user, _ in node.outputs[0].uses())
    }


def _is_table_gather(node) -> bool:
    """A Gather of rows (axis 0) of a constant 2-D float table: an embedding lookup."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or node.attributes.get_int("axis", 0) != 0:
        return False
    table = node.inputs[0]
    tensor = table.const_value if table is not None and table.is_initializer() else None
    return tensor is not None and len(tensor.shape) == 2 and tensor.dtype.name == "FLOAT"


def quantize_matmuls(
    proto, bits: int, *, block_size: int = BLOCK_SIZE, accuracy_level: int = ACCURACY_LEVEL, symmetric: bool = SYMMETRIC
):
    """Every MatMul with a constant 2-D weight -> ``MatMulNBits``; returns (model proto, count)."""
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(
        proto, bits=bits, block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level
    )
    quantizer.process()
    result = quantizer.model.model
    return result, sum(1 for node in result.graph.node if node.op_type == "MatMulNBits")


def quantize_streamed(
    model,
    bits: int,
    data: Path,
    *,
    block_size: int = BLOCK_SIZE,
    accuracy_level: int = ACCURACY_LEVEL,
    symmetric: bool = SYMMETRIC,
    tied: dict[str, str] | None = None,
    gguf_blocks: GGUFBlocks | None = None,
    progress: Progress | None = None,
) -> int:
    """:func:`quantize_matmuls` on an ``onnx_ir`` model one weight at a time, then the embedding tables
    (:func:`_quantize_tables`); returns how many MatMuls.

    ONNX Runtime's block quantizer (the kernel ``MatMulNBitsQuantizer`` calls) runs on each weight, and a
    ``MatMulNBits`` node as that quantizer makes it takes the MatMul's place; a weight whose blocks a GGUF
    source holds in a type ``MatMulNBits`` represents exactly takes those blocks instead (``gguf_blocks``,
    :mod:`qspec.backends.ort_gguf`). Every weight of the result (quantized or kept: norms, RoPE tables) is
    appended to ``data`` at once, each at a page boundary, and the model points at it: memory holds one
    weight and its quantized form, never the graph's weights (a fp32 8B graph is 32 GB), and the graph
    reads no fp32 copy of the model.
    """
    import onnx_ir as ir

    say = progress or (lambda message: None)
    targets = [node for node in model.graph if _quantizable(node)]
    done: dict[str, tuple] = {}  # weight name -> (MatMulNBits inputs beside the activation, attributes, name suffix)
    settings = (block_size, accuracy_level, symmetric)
    begin, last = time.perf_counter(), 0.0
    with open(data, "wb") as sink:
        for count, node in enumerate(targets, 1):
            weight = node.inputs[1]
            if weight.name not in done:
                done[weight.name] = _quantize_weight(weight, bits, settings, sink, data, gguf_blocks)
                for value in done[weight.name][0]:
                    if value is not None:
                        model.graph.register_initializer(value)
            values, attributes, suffix = done[weight.name]
            replacement = ir.node(
                "MatMulNBits",
                [node.inputs[0], *values],
                attributes=attributes,
                domain=MS_DOMAIN,
                name=node.name + suffix,  # named as the whole-graph quantizer names it
            )
            model.graph.insert_before(node, replacement)
            out = node.outputs[0]
            name = out.name
            out.replace_all_uses_with(replacement.outputs[0], replace_graph_outputs=True)
            model.graph.remove(node, safe=True)
            replacement.outputs[0].name = name
            if not weight.uses() and weight.name in model.graph.initializers:
                model.graph.initializers.pop(weight.name)
            now = time.perf_counter()
            if now - last >= 2.0 or count == len(targets):
                last, rate = now, count / (now - begin)
                say(f"quantizing weights: {count}/{len(targets)} MatMuls, ETA {(len(targets) - count) / rate:.0f} s")
        _quantize_tables(model, bits, settings, sink, data, done, tied or {}, gguf_blocks)
        for value in model.graph.initializers.values():  # what stays: norms, RoPE tables
            tensor = value.const_value
            if tensor is not None and tensor.nbytes >= EXTERNAL_MIN_BYTES and not _in_file(tensor, data):
                value.const_value = _append(sink, tensor, data)
    model.opset_imports.setdefault(MS_DOMAIN, 1)
    return len(targets)


MS_DOMAIN = "com.microsoft"
WIDENED_MATMULS = "widened_4bit_matmuls"


def widen_one_row_matmuls(model) -> int:
    """Every 4-bit ``MatMulNBits`` sees at least two rows: a zero row is appended to its activation and its
    output row dropped; returns how many nodes.

    MLAS runs a one-row 4-bit product on a kernel of its own, which on x86 without AVX-512 sums in another
    order than the many-row kernel; a token alone (a one-token call) would then round differently from the
    same token in a verify call, and speculative greedy output would not be plain greedy output. Rows of a
    product of two rows or more are computed alike whatever their count (tests/test_weight_formats.py).
    A package without drafts (``lone_query``) verifies nothing and keeps its one-row products.

    A graph that takes the host's call plan (:mod:`qspec.backends.ort_plan`) widens only a product that has one
    row in this call: the plan's widen pads and ends (:data:`~qspec.backends.ort_plan.WIDEN_PADS`, and the
    ``KEPT_`` pair for the products after the kept-rows gather, the LM head's) are ``[0, 1]`` and ``-1`` for a
    one-token row, ``[0, 0]`` and the end of the axis otherwise, so a verify call or a call of several rows
    runs its products as they are (a pad row costs ~30 % of a one-row product, ~0 for five). Without a plan
    every 4-bit product is widened.
    """
    import numpy as np
    import onnx_ir as ir

    from qspec.backends import ort_plan

    nodes = [
        node
        for node in model.graph
        if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN and node.attributes.get_int("bits", 4) == 4
    ]
    if not nodes:
        return 0

    def constant(name: str, values: list[int]):
        value = ir.Value(name=name, const_value=ir.tensor(np.array(values, np.int64)))
        model.graph.register_initializer(value)
        return value

    def plan_input(name: str, size: int):
        value = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([size]))
        model.graph.inputs.append(value)
        return value

    inputs = {value.name: value for value in model.graph.inputs}
    axes, starts = constant("widen_axes", [-2]), constant("widen_starts", [0])
    if ort_plan.SEQ in inputs:  # the host's plan says which products have one row
        kept = _downstream(inputs[ort_plan.KEPT_SLOTS]) if ort_plan.KEPT_SLOTS in inputs else set()
        names = {
            False: (ort_plan.WIDEN_PADS, ort_plan.WIDEN_ENDS),
            True: (ort_plan.KEPT_WIDEN_PADS, ort_plan.KEPT_WIDEN_ENDS),
        }
        used = sorted({node.inputs[0] in kept for node in nodes})  # the call's tokens, then the kept rows
        pairs = {group: (plan_input(names[group][0], 2), plan_input(names[group][1], 1)) for group in used}
        widths = {node.name: pairs[node.inputs[0] in kept] for node in nodes}
    else:
        always = (constant("widen_pads", [0, 1]), constant("widen_ends", [-1]))
        widths = {node.name: always for node in nodes}
    for node in nodes:
        pads, ends = widths[node.name]
        pad = ir.node("Pad", [node.inputs[0], pads, None, axes], name=node.name + "_widen")
        model.graph.insert_before(node, pad)
        node.replace_input_with(0, pad.outputs[0])
        out = node.outputs[0]
        cut = ir.node("Slice", [out, starts, ends, axes], name=node.name + "_narrow")
        model.graph.insert_after(node, cut)
        for user, index in list(out.uses()):
            if user is not cut:
                user.replace_input_with(index, cut.outputs[0])
        if out.is_graph_output():
            outputs = model.graph.outputs
            outputs[outputs.index(out)] = cut.outputs[0]
            name = out.name
            out.name = f"{name}_widened"
            cut.outputs[0].name = name
    return len(nodes)


def _downstream(value) -> set:
    """The values computed from ``value`` (itself included)."""
    seen, todo = {value}, [value]
    while todo:
        for user, _ in todo.pop().uses():
            for out in user.outputs:
                if out not in seen:
                    seen.add(out)
                    todo.append(out)
    return seen


def _quantizable(node) -> bool:
    """A MatMul whose second input is a constant 2-D float weight (what ONNX Runtime's quantizer takes)."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    weight = node.inputs[1]
    tensor = weight.const_value if weight is not None and weight.is_initializer() else None
    return tensor is not None and len(tensor.shape) == 2 and tensor.dtype.name == "FLOAT"


def _block_quantize(array, bits: int, settings: tuple, gguf_blocks: GGUFBlocks | None):
    """``array`` ``[K, N]`` in blocks along K: (bits, B ``[N, K / block, block * bits / 8]``, scales, zero points or
    None), the GGUF source's own blocks where it holds them exactly, else ONNX Runtime's block quantizer's."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    block_size, accuracy_level, symmetric = settings
    if gguf_blocks is not None and symmetric and block_size == GGUF_BLOCK:
        carried = gguf_blocks.blocks_for(array)
        if carried is not None:
            return carried.bits, carried.packed, carried.scales, None
    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level, bits=bits
    )
    packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(array)
    return bits, packed, scales, None if symmetric else zero_points


def _quantize_weight(weight, bits: int, settings: tuple, sink, data: Path, gguf_blocks: GGUFBlocks | None = None):
    """ONNX Runtime's block quantizer (or the GGUF source's blocks) on ``weight`` alone: (its MatMulNBits inputs,
    appended to ``sink``; the node's attributes; its name suffix), named and laid out as ``MatMulNBitsQuantizer``
    makes them.

    A weight in C order is read in place (a view of the mapped file where it is external), without a copy.
    """
    import numpy as np
    import onnx_ir as ir

    block_size, accuracy_level, _ = settings
    # [K, N], C order: the kernel reads raw memory (a folded tied head is a transposed view of the embedding)
    array = np.ascontiguousarray(weight.const_value.numpy())
    bits, packed, scales, zero_points = _block_quantize(array, bits, settings, gguf_blocks)
    k, n = array.shape
    del array
    _release(weight.const_value)
    arrays = {f"{weight.name}_Q{bits}": packed, f"{weight.name}_scales": scales}
    if zero_points is not None:
        arrays[f"{weight.name}_zero_points"] = zero_points
    values = []
    for name, quantized in arrays.items():
        stored = _append(sink, ir.tensor(quantized, name=name), data)
        values.append(ir.Value(name=name, shape=stored.shape, type=ir.TensorType(stored.dtype), const_value=stored))
    attributes = {"K": k, "N": n, "bits": bits, "block_size": block_size}
    if accuracy_level:  # the quantizer leaves an unset level out
        attributes["accuracy_level"] = accuracy_level
    return values, attributes, f"_Q{bits}"


def _quantize_tables(model, bits: int, settings: tuple, sink, data: Path, done: dict, tied: dict, gguf_blocks) -> None:
    """Every embedding ``Gather`` -> ``GatherBlockQuantized``, as ONNX Runtime GenAI's builder stores it: a tied
    table reads the LM head's ``MatMulNBits`` blocks (reshaped to ``[vocab, hidden * bits / 8]``) and scales, so
    the table is stored once, in the head's format; an untied one is block-quantized on its own, each token's
    row as a MatMul weight's output row (the GGUF source's blocks where it holds them exactly)."""
    import numpy as np

    heads = {table: head for head, table in tied.items() if head in done}
    quantized: dict[str, tuple] = {}  # table name -> (B, scales, bits)
    for node in [node for node in model.graph if _is_table_gather(node)]:
        table = node.inputs[0]
        if table.shape[1] % settings[0]:  # GatherBlockQuantized takes whole blocks only
            continue
        if table.name in heads:
            values, attributes, _ = done[heads[table.name]]
            quantized[table.name] = (values[0], values[1], attributes["bits"])
        elif table.name not in quantized:
            array = np.ascontiguousarray(table.const_value.numpy().T)  # [hidden, vocab]: a row per token
            used, packed, scales, _ = _block_quantize(array, bits, (*settings[:2], True), gguf_blocks)
            del array
            arrays = {f"{table.name}_Q{used}": packed, f"{table.name}_scales": scales}
            quantized[table.name] = (*(_store(model, sink, data, name, a) for name, a in arrays.items()), used)
        _gather_blocks(model, node, *quantized[table.name], block_size=settings[0])
        if not table.uses() and table.name in model.graph.initializers:
            model.graph.initializers.pop(table.name)
            _release(table.const_value)


def _gather_blocks(model, node, blocks, scales, bits: int, *, block_size: int) -> None:
    """Replace the table ``Gather`` ``node`` by ``GatherBlockQuantized`` over ``Reshape(blocks)`` and ``scales``."""
    import numpy as np
    import onnx_ir as ir

    vocab, hidden = node.inputs[0].shape
    name = f"{blocks.name}_shape"
    if name not in model.graph.initializers:
        model.graph.register_initializer(
            ir.Value(name=name, const_value=ir.tensor(np.array([vocab, hidden * bits // 8])))
        )
    reshape = ir.node("Reshape", [blocks, model.graph.initializers[name]], name=f"{node.name}_reshape")
    gather = ir.node(
        "GatherBlockQuantized",
        [reshape.outputs[0], node.inputs[1], scales],
        attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": block_size, "bits": bits},
        domain=MS_DOMAIN,
        name=f"{node.name}_Q{bits}",
    )
    model.graph.insert_before(node, [reshape, gather])
    out = node.outputs[0]
    name = out.name
    out.replace_all_uses_with(gather.outputs[0], replace_graph_outputs=True)
    model.graph.remove(node, safe=True)
    gather.outputs[0].name = name


def _store(model, sink, data: Path, name: str, array):
    """``array`` appended to ``data`` as the initializer ``name`` of ``model``; its value."""
    import onnx_ir as ir

    tensor = _append(sink, ir.tensor(array, name=name), data)
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    model.graph.register_initializer(value)
    return value


def _append(sink, tensor, data: Path):
    """Write ``tensor`` to the open ``data`` file at the next page boundary; the external tensor pointing at it."""
    import onnx_ir as ir

    offset = -(-sink.tell() // PAGE_BYTES) * PAGE_BYTES
    sink.seek(offset)
    tensor.tofile(sink)
    length = sink.tell() - offset
    _release(tensor)
    return ir.ExternalTensor(
        data.name, offset, length, tensor.dtype, shape=tensor.shape, name=tensor.name, base_dir=data.parent
    )


def _release(tensor) -> None:
    """Unmap an external tensor's file, so the pages read through it stop counting in this process's memory.

    Where another array still views it (a table a fusion read), it stays mapped until that one goes.
    """
    import onnx_ir as ir

    if isinstance(tensor, ir.ExternalTensor):
        with contextlib.suppress(BufferError):
            tensor.release()


def _in_file(tensor, data: Path) -> bool:
    import onnx_ir as ir

    return isinstance(tensor, ir.ExternalTensor) and Path(tensor.path).resolve() == data.resolve()


def external_data_files(model) -> set[str]:
    """Names of the files the model's external tensors are in."""
    import onnx_ir as ir

    tensors = (value.const_value for value in model.graph.initializers.values())
    return {Path(tensor.path).name for tensor in tensors if isinstance(tensor, ir.ExternalTensor)}
