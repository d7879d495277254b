"""Probe: ONNX Runtime's CPU GroupQueryAttention gives a tree's sibling, written at chunk slot p + j and masked
from the slots between (attention_bias -inf), bit-identical output to the same token at slot p + 1 only when
j = 1 (mod the softmax's lane width: 8 with AVX2). Prints, per j, whether the outputs are equal.

    python scripts/tree_softmax_lanes.py [--seed 0] [--cached 6]
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h

HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 4, 2, 16, 400


def session() -> ort.InferenceSession:
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    cache = [1, KV_HEADS, CAPACITY, HEAD_DIM]
    inputs = [
        h.make_tensor_value_info("qkv", T.FLOAT, [1, "S", width]),
        h.make_tensor_value_info("past_key", T.FLOAT, cache),
        h.make_tensor_value_info("past_value", T.FLOAT, cache),
        h.make_tensor_value_info("seqlens_k", T.INT32, [1]),
        h.make_tensor_value_info("total", T.INT32, []),
        h.make_tensor_value_info("query_seqlens", T.INT32, [1]),
        h.make_tensor_value_info("position_ids", T.INT64, [1, "S"]),
        h.make_tensor_value_info("bias", T.FLOAT, [1, 1, "S", "T"]),
    ]
    freqs = np.arange(512)[:, None] / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)[None]
    tables = [
        onnx.numpy_helper.from_array(f(freqs).astype(np.float32), name)
        for f, name in ((np.cos, "cos"), (np.sin, "sin"))
    ]
    names = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin", "position_ids", "bias"]
    node = h.make_node(
        "GroupQueryAttention",
        [*names, "", "", "", "", "", "query_seqlens"],
        ["out", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        do_rotary=1,
        scale=HEAD_DIM**-0.5,
    )
    outputs = [
        h.make_tensor_value_info("out", T.FLOAT, [1, "S", HEADS * HEAD_DIM]),
        h.make_tensor_value_info("present_key", T.FLOAT, cache),
        h.make_tensor_value_info("present_value", T.FLOAT, cache),
    ]
    graph = h.make_graph([node], "probe", inputs, outputs, tables)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cached", type=int, default=6, help="tokens in the cache before the call (p)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    p, sess = args.cached, session()
    key, value = (rng.normal(size=(1, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float32) for _ in range(2))
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    last, sibling = (rng.normal(size=width).astype(np.float32) for _ in range(2))

    def run(rows: list[np.ndarray], positions: list[int], hidden: list[tuple[int, int]]) -> np.ndarray:
        n = len(rows)
        bias = np.zeros((1, 1, n, p + n), np.float32)
        for row, slot in hidden:
            bias[0, 0, row, p + slot] = -np.inf
        keys, values = key.copy(), value.copy()  # the OrtValues wrap these: keep them alive
        k, v = ort.OrtValue.ortvalue_from_numpy(keys), ort.OrtValue.ortvalue_from_numpy(values)
        binding = sess.io_binding()
        binding.bind_output("out")
        feeds = {
            "qkv": np.stack(rows)[None],
            "seqlens_k": np.array([p + n - 1], np.int32),
            "total": np.array(p + n, np.int32),
            "query_seqlens": np.array([n], np.int32),
            "position_ids": np.array([positions], np.int64),
            "bias": bias,
        }
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        binding.bind_ortvalue_input("past_key", k)
        binding.bind_ortvalue_input("past_value", v)
        binding.bind_ortvalue_output("present_key", k)
        binding.bind_ortvalue_output("present_value", v)
        sess.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0][0]

    alone = run([last, sibling], [p, p + 1], [])[1]
    for j in range(2, 34):
        chain = [rng.normal(size=width).astype(np.float32) for _ in range(j - 1)]
        positions = [p, *range(p + 1, p + j), p + 1]
        out = run([last, *chain, sibling], positions, [(j, slot) for slot in range(1, j)])[j]
        print(f"j={j:2d} equal={np.array_equal(out, alone)!s:5} max_diff={float(np.abs(out - alone).max()):.2e}")


if __name__ == "__main__":
    main()
