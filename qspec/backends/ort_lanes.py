"""How many lanes ONNX Runtime's CPU ``GroupQueryAttention`` sums a softmax in, probed on a one-node graph.

A tree's draft off the chain runs at another slot of the op's query than a plain call would run it at
(:func:`qspec.backends.ort_plan.op_slots`); its scores are the same, but the kernel adds the softmax's
exponentials in lanes, so the sum rounds alike only when the slot is the plain one plus a multiple of the lane
count (the masked slots between add exact zeros). The probe runs a token at slot ``1`` and at slot ``1 + L``
(the slots between masked) on random inputs and returns the smallest ``L`` that always gives the same output
(8 on an AVX2 machine); None when none up to ``TREE_LANES_MAX`` does (then no tree is verified).
"""

from __future__ import annotations

import functools

import numpy as np

from qspec.package import TREE_LANES_MAX

HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 4, 2, 16, 96
TRIALS = ((0, 6), (1, 13), (2, 30), (3, 7), (4, 41), (5, 22))  # (seed, cached tokens)


@functools.cache
def softmax_lanes() -> int | None:
    """The smallest lane count ``L`` (1, 2, 4, ... ``TREE_LANES_MAX``) for which a token ``L`` slots past its
    plain one gets bit-identical attention output in every trial."""
    session = probe_session()
    lanes = 1
    while lanes <= TREE_LANES_MAX:
        if all(_same(session, seed, cached, lanes) for seed, cached in TRIALS):
            return lanes
        lanes *= 2
    return None


def _same(session, seed: int, cached: int, lanes: int) -> bool:
    rng = np.random.default_rng(seed)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    kv = tuple(rng.normal(size=(1, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float32) for _ in range(2))
    last, token = (rng.normal(size=width).astype(np.float32) for _ in range(2))
    filler = [rng.normal(size=width).astype(np.float32) for _ in range(lanes)]
    alone = attend(session, kv, [last, token], [cached, cached + 1], cached)[-1]
    hidden = [(lanes + 1, slot) for slot in range(1, lanes + 1)]  # the probed token sees `last` and itself
    rows, positions = [last, *filler, token], [*range(cached, cached + lanes + 1), cached + 1]
    moved = attend(session, kv, rows, positions, cached, hidden)[-1]  # the token at slot 1 + L
    return bool(np.array_equal(alone, moved))


def attend(
    session, kv: tuple[np.ndarray, np.ndarray], rows: list[np.ndarray], positions: list[int], cached: int,
    hidden: list[tuple[int, int]] = (),
) -> np.ndarray:  # fmt: skip
    """The probe graph's attention output ``[len(rows), width]`` for ``rows`` written from slot ``cached`` at RoPE
    ``positions``, over a copy of the cache ``kv``; ``hidden``: (row, call slot) pairs the bias masks (-inf)."""
    import onnxruntime as ort

    n = len(rows)
    bias = np.zeros((1, 1, n, cached + n), np.float32)
    for row, slot in hidden:
        bias[0, 0, row, cached + slot] = -np.inf
    keys, values = kv[0].copy(), kv[1].copy()  # the OrtValues wrap these
    k, v = ort.OrtValue.ortvalue_from_numpy(keys), ort.OrtValue.ortvalue_from_numpy(values)
    binding = session.io_binding()
    binding.bind_output("out")
    feeds = {
        "qkv": np.stack(rows)[None],
        "seqlens_k": np.array([cached + n - 1], np.int32),
        "total": np.array(cached + n, np.int32),
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
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0][0]


def probe_session(capacity: int = CAPACITY):
    """A one-node GroupQueryAttention graph (the probe's shapes) over a KV cache of ``capacity`` slots."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper as h

    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    cache = [1, KV_HEADS, capacity, HEAD_DIM]
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
    freqs = np.arange(2 * capacity)[:, None] / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)[None]
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
    graph = h.make_graph([node], "lanes", inputs, outputs, tables)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
