"""The micro-benchmark: one call per specialization of a loaded package, against the bandwidth floor;
and the time to first token per prefill chunk size.

The floor of one call is ``weight bytes / copy bandwidth``: every call streams all the weights once.
The weight bytes are the package's own (``manifest.runtime_graph.weight_bytes``): an int4 package's
floor is its packed 4-bit weights, scales and zero points, not fp32's.
"""

from __future__ import annotations

import time
from statistics import median

import numpy as np

from qspec.bench.report import MicroCall, MicroPackage, PrefillChunk


def prepare_call(model, bound) -> None:
    """Write a timed call's inputs into ``bound``: every row a live token run.

    Rows end at position 255 (or at the bucket's or buffer's end, if smaller), so shapes that differ
    only in their compute-context-length bucket are timed at the same positions.
    """
    rows, seq = bound.input_ids.shape  # [batch_size, seq_len]
    start = max(0, min(256, bound.spec.comp_ctx_lengths or model.ctx_len) - seq)
    bound.input_ids.fill(1)
    bound.position_ids[:] = np.arange(start, start + seq)
    if bound.batch_index is not None:
        bound.batch_index[:, 0] = np.arange(rows)


def time_calls(model, bounds: list, iterations: int, *, rounds: int = 5, warmup: int = 3) -> list[float]:
    """Median ms of ``iterations`` calls of each specialization in ``bounds``, timed interleaved.

    The calls run in ``rounds`` rounds, each a share of every specialization's calls in turn, so a
    ratio between two specializations is not the machine's speed drifting between them (a shared
    VM's speed moves over minutes).
    """
    for bound in bounds:  # each binding keeps its own inputs; the shapes share only the KV buffer
        prepare_call(model, bound)
        for _ in range(warmup):
            model.run(bound)
    rounds = max(1, min(rounds, iterations))
    times: list[list[float]] = [[] for _ in bounds]
    for r in range(rounds):
        share = iterations // rounds + (r < iterations % rounds)
        for bound, took in zip(bounds, times):
            for _ in range(share):
                begin = time.perf_counter()
                model.run(bound)
                took.append(time.perf_counter() - begin)
    return [median(took) * 1000 for took in times]


def _every_shape(model):
    """(name, binding) of every specialization: ``prefill``, ``K=4``, and ``@256`` per bucket when bucketed."""

    def at(ccl):
        return f"@{ccl}" if ccl else ""

    yield from ((f"prefill{at(c)}", model.prefill_for(c or model.ctx_len)) for c in model.prefill_buckets)
    for c in model.decode_buckets:
        yield from ((f"K={k}{at(c)}", model.decode_for(k, c or model.ctx_len)) for k in model.ks)


def micro_benchmark(
    model, iterations: int, bandwidth: float, *, batch: int, weight_format: str = "fp32", graph: str = "runtime"
) -> MicroPackage:
    """One row per specialization of ``model`` (a loaded CompiledModel): median ms and the ratio to its floor."""
    weight_bytes = model.weight_bytes()
    floor_ms = weight_bytes / bandwidth * 1000
    calls = []
    shapes = list(_every_shape(model))
    timed = time_calls(model, [bound for _, bound in shapes], iterations)
    for (name, bound), ms in zip(shapes, timed):
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
        weight_format=weight_format,
        graph=graph,
        package=str(model.package),
        weight_bytes=weight_bytes,
        floor_ms=round(floor_ms, 2),
        iterations=iterations,
        calls=calls,
    )


def prefill_sweep(
    package, prompts: list[list[int]], sizes: list[int], *, weight_format: str, rounds: int = 2, num_threads=None
) -> list[PrefillChunk]:
    """Median time to first token of every prompt (batch 1, greedy) with prompts prefilled in chunks of
    each of ``sizes`` tokens: the package loaded once per size with that ``prefill_seq_len`` (what it
    runs compiled with ``--prefill-seq-len``), timed interleaved prompt by prompt."""
    from qspec.runtime import Engine, SamplingParams
    from qspec.runtime.model import CompiledModel

    engines = {
        n: Engine(package, method="none", model=CompiledModel(package, num_threads=num_threads, prefill_seq_len=n))
        for n in sizes
    }
    default = next(iter(engines.values())).model.manifest.config.prefill_seq_len
    params = SamplingParams(max_new_tokens=1)
    ttft: dict[int, list[float]] = {n: [] for n in sizes}
    calls: dict[int, int] = dict.fromkeys(sizes, 0)
    for _ in range(rounds):
        for prompt in prompts:
            for n, engine in engines.items():
                output = engine.generate([prompt], params)[0]
                ttft[n].append((output.metrics.first_token_time - output.metrics.arrival) * 1000)
                calls[n] += engine.last_metrics.calls["prefill"]
    return [
        PrefillChunk(
            weight_format=weight_format,
            prefill_seq_len=n,
            ttft_median_ms=round(median(ttft[n]), 2),
            prefill_calls_per_prompt=round(calls[n] / (rounds * len(prompts)), 2),
            package_default=n == default,
        )
        for n in sizes
    ]
