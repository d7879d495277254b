"""GGUF blocks carried into ``MatMulNBits`` as they are: a GGUF user's int4/int8 package runs llama.cpp's weights.

A GGUF block and a ``MatMulNBits`` block are both 32 consecutive weights along the input dimension K of one
output row, so a block that ``MatMulNBits`` can hold is copied, not re-quantized. Which GGUF types it holds
exactly (``value = scale * (q - zero_point)``, fp32 scales, no zero-point input: 8 for 4 bits, 128 for 8):

=======  ==========================  ==============================================================
type     GGUF block                  in MatMulNBits
=======  ==========================  ==============================================================
Q4_0     fp16 d, 32 x 4-bit q        exact: scale d, q as is (``d * (q - 8)``, nibbles re-paired)
Q8_0     fp16 d, 32 x int8 q         exact: scale d, ``q + 128`` (``d * q``)
Q4_1     fp16 d, fp16 m, 4-bit q     not exact: ``d * q + m`` needs a float zero point ``-m / d``,
                                     rounded (so is ``(q - zp) * d``), and ONNX Runtime runs float
                                     zero points unpacked (de-quantizes every weight on every call)
K-quants super-blocks of 256, 6-bit    Q4_K's sub-blocks are Q4_1-like (scale and min): as Q4_1;
(Q2..6_K) sub-block scales and mins    Q5_K / Q6_K / Q3_K have 5, 6 or 3 bits: MatMulNBits has 2, 4, 8
IQ*      codebooks (non-uniform)     not affine in q: no scale/zero point represents them
=======  ==========================  ==============================================================

The weights of the exported graph are the GGUF's de-quantized values (transformers' loader, rows permuted
for some families, q/k/v packed by the runtime graph), so rows are found by their values, not their names:
every row of a GGUF tensor of a kept type is fingerprinted after de-quantization, each output row of a
MatMul weight is looked up, and the blocks found are used only when they de-quantize bit for bit to the
weight (else ONNX Runtime's quantizer runs on it, as for any other weight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BLOCK = 32  # weights per block of every type kept here (QK4_0 = QK8_0 = 32)
# GGUF types kept exactly -> the bits of their MatMulNBits (whatever the package's format: a GGUF weight is kept
# at its own bits, so an int4 package of a file with a Q8_0 LM head runs it in 8 bits, as llama.cpp does)
EXACT_TYPES: dict[str, int] = {"Q4_0": 4, "Q8_0": 8}


def _fingerprints(rows: np.ndarray) -> np.ndarray:
    """``[rows]`` uint64: a hash of each fp32 row's bits (collisions are harmless: a match is checked by value)."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32).astype(np.uint64)
    weights = np.random.default_rng(len(rows[0])).integers(1, 1 << 63, size=bits.shape[1], dtype=np.uint64) | 1
    with np.errstate(over="ignore"):
        return (bits * weights).sum(axis=1, dtype=np.uint64)


def to_matmul_nbits(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks ``[N, K / 32, bytes per block]`` -> ``MatMulNBits`` (B ``[N, K / 32, 32 * bits / 8]`` uint8,
    scales ``[N * K / 32]`` float32), for a type of :data:`EXACT_TYPES`.

    Q4_0 stores the low nibbles of a block's 16 bytes as weights 0..15 and the high ones as 16..31;
    ``MatMulNBits`` packs weights 2i and 2i + 1 into byte i (low nibble first).
    """
    scales = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32).reshape(-1)
    if type_name == "Q4_0":
        qs = raw[..., 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, blocks, 32], weights in order
        return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), scales
    if type_name == "Q8_0":
        return (raw[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), scales
    raise ValueError(f"GGUF type {type_name} is not one MatMulNBits holds exactly ({', '.join(EXACT_TYPES)})")


@dataclass(frozen=True)
class Carried:
    """A MatMul weight's GGUF blocks as ``MatMulNBits`` inputs."""

    type_name: str
    bits: int
    packed: np.ndarray  # [N, K / 32, 32 * bits / 8] uint8
    scales: np.ndarray  # [N, K / 32] float32


@dataclass
class GGUFBlocks:
    """The rows of a GGUF file's tensors of the kept types, found by their de-quantized values.

    ``blocks_for(weight)`` gives the ``MatMulNBits`` inputs of a ``[K, N]`` MatMul weight whose every output
    row is such a row (all of one type), or None.
    """

    reader: object  # gguf.GGUFReader: the file mapped, tensors read when sliced
    rows: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)  # K -> fingerprint -> (tensor, row)
    carried: dict[str, int] = field(default_factory=dict)  # GGUF type -> weights served from the file's blocks

    @classmethod
    def index(cls, path: str | Path) -> GGUFBlocks | None:
        """Fingerprint every row of the file's tensors of a type in :data:`EXACT_TYPES`; None when it has none."""
        import gguf

        reader = gguf.GGUFReader(path)
        kept = cls(reader)
        for number, tensor in enumerate(reader.tensors):
            if tensor.tensor_type.name not in EXACT_TYPES:
                continue
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            values = values.reshape(-1, values.shape[-1])
            table = kept.rows.setdefault(values.shape[-1], {})
            for row, print_ in enumerate(_fingerprints(values).tolist()):
                table.setdefault(print_, (number, row))
        return kept if kept.rows else None

    def blocks_for(self, weight: np.ndarray) -> Carried | None:
        """``MatMulNBits`` B and scales for ``weight`` ``[K, N]`` from the file's blocks, when every output row
        is in the file, all of one type, and its blocks de-quantize bit for bit to it; else None."""
        import gguf

        k = weight.shape[0]
        table = self.rows.get(k)
        if table is None or k % BLOCK:
            return None
        columns = np.ascontiguousarray(weight.T)  # [N, K]: one output row each
        found = [table.get(p) for p in _fingerprints(columns).tolist()]
        if any(f is None for f in found):
            return None
        types = {self.reader.tensors[t].tensor_type for t, _ in found}
        if len(types) != 1:
            return None
        [qtype] = types
        tensors = {t: self.reader.tensors[t].data for t, _ in found}
        raw = np.stack([tensors[t].reshape(-1, tensors[t].shape[-1])[r] for t, r in found])
        if not np.array_equal(gguf.quants.dequantize(raw, qtype).view(np.uint32), columns.view(np.uint32)):
            return None
        self.carried[qtype.name] = self.carried.get(qtype.name, 0) + 1
        packed, scales = to_matmul_nbits(raw.reshape(len(found), k // BLOCK, -1), qtype.name)
        return Carried(qtype.name, EXACT_TYPES[qtype.name], packed, scales.reshape(len(found), k // BLOCK))
