"""The micro-benchmark: one call per specialization of a loaded package, against the bandwidth floor.

The floor of one call is ``weight bytes / copy bandwidth``: every call streams all the weights once.
"""

from __future__ import annotations

import time
from statistics import median

import numpy as np

from qspec.bench.report import MicroCall, MicroPackage


def time_call(model, bound, iterations: int, *, warmup: int = 3) -> float:
    """Median ms of ``iterations`` calls of one specialization, every row a live token run."""
    rows, seq = bound.input_ids.shape  # [batch_size, seq_len]
    start = max(0, min(256, model.ctx_len - seq))
    bound.input_ids.fill(1)
    bound.position_ids[:] = np.arange(start, start + seq)
    if bound.batch_index is not None:
        bound.batch_index[:, 0] = np.arange(rows)
    for _ in range(warmup):
        model.run(bound)
    times = []
    for _ in range(iterations):
        begin = time.perf_counter()
        model.run(bound)
        times.append(time.perf_counter() - begin)
    return median(times) * 1000


def micro_benchmark(model, iterations: int, bandwidth: float, *, batch: int) -> MicroPackage:
    """One row per specialization of ``model`` (a loaded CompiledModel): median ms and the ratio to the floor."""
    weight_bytes = model.weight_bytes()
    floor_ms = weight_bytes / bandwidth * 1000
    calls = []
    for name, bound in [("prefill", model.prefill), *((f"K={k}", model.decode[k]) for k in model.ks)]:
        ms = time_call(model, bound, iterations)
        calls.append(
            MicroCall(
                specialization=name,
                shape=bound.spec.describe(),
                median_ms=round(ms, 2),
                tokens_per_call=int(bound.input_ids.size),
                ratio_to_floor=round(ms / floor_ms, 2),
            )
        )
    return MicroPackage(
        batch=batch,
        package=str(model.package),
        weight_bytes=weight_bytes,
        floor_ms=round(floor_ms, 2),
        iterations=iterations,
        calls=calls,
    )
