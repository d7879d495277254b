"""Probe: ONNX Runtime's CPU GroupQueryAttention gives a tree's sibling, written at chunk slot p + j and masked
from the slots between (attention_bias -inf), bit-identical output to the same token at slot p + 1 for every p
when j = 1 (mod the softmax's lane width: 8 with AVX2); at other j it is equal for some p only (at p = 6, also
j = 7, 8 mod 8). Prints, per j, whether the outputs are equal.

    python scripts/tree_softmax_lanes.py [--seed 0] [--cached 6]
"""

from __future__ import annotations

import argparse

import numpy as np

from qspec.backends.ort_lanes import HEAD_DIM, HEADS, KV_HEADS, attend, probe_session

CAPACITY = 400


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cached", type=int, default=6, help="tokens in the cache before the call (p)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    p, sess = args.cached, probe_session(CAPACITY)
    kv = tuple(rng.normal(size=(1, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float32) for _ in range(2))
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    last, sibling = (rng.normal(size=width).astype(np.float32) for _ in range(2))
    alone = attend(sess, kv, [last, sibling], [p, p + 1], p)[1]
    for j in range(2, 34):
        chain = [rng.normal(size=width).astype(np.float32) for _ in range(j - 1)]
        positions = [p, *range(p + 1, p + j), p + 1]
        out = attend(sess, kv, [last, *chain, sibling], positions, p, [(j, slot) for slot in range(1, j)])[j]
        print(f"j={j:2d} equal={np.array_equal(out, alone)!s:5} max_diff={float(np.abs(out - alone).max()):.2e}")


if __name__ == "__main__":
    main()
