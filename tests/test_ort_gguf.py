"""GGUF blocks carried into MatMulNBits (qspec.backends.ort_gguf), on tiny GGUF files written by gguf's own writer."""

from __future__ import annotations

import gguf
import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as Q
from onnx import TensorProto, helper, numpy_helper

from qspec.backends.ort_gguf import EXACT_TYPES, GGUFBlocks

K, ROWS = 96, 40  # 3 blocks of 32 per row


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    """A GGUF file holding ``tensors`` quantized by gguf's own quantizers (llama.cpp's block layouts)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, qtype) in tensors.items():
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tensors = {
        f"blk.0.{qtype.name.lower()}.weight": (rng.standard_normal((ROWS, K)).astype(np.float32), qtype)
        for qtype in (Q.Q4_0, Q.Q8_0, Q.Q4_1)
    }
    write_gguf(path, tensors)
    return path


def dequantized(path, qtype: Q) -> np.ndarray:
    """``[rows, K]``: the GGUF tensor of ``qtype`` as gguf (and transformers' GGUF loader) de-quantizes it."""
    [tensor] = [t for t in gguf.GGUFReader(path).tensors if t.tensor_type == qtype]
    return gguf.quants.dequantize(tensor.data, qtype)


def matmul_nbits_weight(packed, scales, bits: int, k: int, zero_points=None) -> np.ndarray:
    """``[K, N]``: what ONNX Runtime's MatMulNBits computes with these blocks for an identity input (fp32
    activations, accuracy level 0: each output is one weight times 1, so the weight itself)."""
    n = packed.shape[0]
    inputs = ["x", "B", "scales"] + (["zp"] if zero_points is not None else [])
    initializers = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")]
    if zero_points is not None:
        initializers.append(numpy_helper.from_array(zero_points, "zp"))
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=32)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])],
        initializer=initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": np.eye(k, dtype=np.float32)})[0]


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Exactly equal, value for value (float ==: bit for bit but for the sign of zero, which the identity
    product's sum of +0 terms drops from a -0 weight)."""
    return a.shape == b.shape and bool(np.all(a == b))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_q4_0_and_q8_0_blocks_dequantize_bit_exactly_in_matmul_nbits(gguf_file, qtype):
    """The MatMulNBits weights made from a Q4_0 / Q8_0 tensor's blocks equal the GGUF's de-quantized values bit
    for bit, in ONNX Runtime itself, at the type's own bits."""
    values = dequantized(gguf_file, qtype)  # [N, K]
    carried = GGUFBlocks.index(gguf_file).blocks_for(np.ascontiguousarray(values.T))
    assert carried is not None and carried.type_name == qtype.name and carried.bits == EXACT_TYPES[qtype.name]
    assert carried.packed.shape == (ROWS, K // 32, 32 * carried.bits // 8) and carried.scales.shape == (ROWS, K // 32)
    assert same_values(matmul_nbits_weight(carried.packed, carried.scales, carried.bits, K), values.T.copy())


def test_rows_are_found_by_value_permuted_and_packed(gguf_file):
    """A weight whose output rows are a GGUF tensor's rows reordered (Llama's q/k permutation) and concatenated
    with another's (packed q/k/v) takes their blocks, still bit-exact."""
    q4 = dequantized(gguf_file, Q.Q4_0)
    rows = np.concatenate([q4[::-1], q4[:7]])  # [N, K]
    blocks = GGUFBlocks.index(gguf_file)
    carried = blocks.blocks_for(np.ascontiguousarray(rows.T))
    assert carried is not None and blocks.carried == {"Q4_0": 1}
    assert same_values(matmul_nbits_weight(carried.packed, carried.scales, 4, K), rows.T.copy())


def test_weights_not_in_the_file_or_mixing_types_are_left_to_the_quantizer(gguf_file):
    """A weight with one row that is no GGUF row, or rows of two types, is not carried (None: ONNX Runtime's
    quantizer runs on it)."""
    blocks = GGUFBlocks.index(gguf_file)
    q4 = dequantized(gguf_file, Q.Q4_0)
    changed = q4.copy()
    changed[3, 5] = np.nextafter(changed[3, 5], np.float32(np.inf))
    mixed = np.concatenate([q4, dequantized(gguf_file, Q.Q8_0)])
    assert blocks.blocks_for(np.ascontiguousarray(changed.T)) is None
    assert blocks.blocks_for(np.ascontiguousarray(mixed.T)) is None
    assert blocks.blocks_for(np.ascontiguousarray(dequantized(gguf_file, Q.Q4_1).T)) is None
    assert blocks.carried == {}


def test_q4_1_is_not_exact_with_a_float_zero_point(gguf_file):
    """Q4_1 (x = d * q + m) as MatMulNBits needs the float zero point -m / d: ONNX Runtime's (q - zp) * d rounds
    away from the GGUF's d * q + m for some weights, which is why Q4_1 is re-quantized, not carried."""
    [tensor] = [t for t in gguf.GGUFReader(gguf_file).tensors if t.tensor_type == Q.Q4_1]
    raw = tensor.data.reshape(ROWS, K // 32, -1)  # per block: fp16 d, fp16 m, 16 bytes of nibbles
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = raw[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    weight = matmul_nbits_weight(packed, d, 4, K, zero_points=(-m / d).astype(np.float32))
    values = dequantized(gguf_file, Q.Q4_1).T
    assert np.allclose(weight, values, rtol=1e-6, atol=1e-6)  # the same weights up to rounding ...
    assert not same_values(weight, values.copy())  # ... but not bit for bit
