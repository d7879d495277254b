"""The micro-benchmark: one call per specialization of a loaded package, against the bandwidth floor;
and the time to first token per prefill chunk size.

The floor of one call is ``weight bytes / copy bandwidth``: every call streams all the weights once.
The weight bytes are the package's own (``manifest.runtime_graph.weight_bytes``): an int4 package's
floor is its packed 4-bit weights, scales and zero points, not fp32's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from qspec.bench.machine import copy_bandwidth
from qspec.bench.options import BenchOptions
from qspec.bench.plan import Steps
from qspec.bench.report import MicroCall, MicroHead, MicroPackage, MicroReport, PrefillChunk
from qspec.head_manifest import has_head

TIMED_POSITION = 256  # timed calls end at this position (or at the bucket's or buffer's end, if smaller)


def prepare_call(model, bound) -> None:
    """Write a timed call's inputs into ``bound``: every row a live token run.

    Rows end at position 255 (or at the bucket's or buffer's end, if smaller), so shapes that differ
    only in their compute-context-length bucket are timed at the same positions.
    """
    rows, seq = bound.input_ids.shape  # [batch_size, seq_len]
    start = max(0, min(TIMED_POSITION, bound.spec.comp_ctx_lengths or model.ctx_len) - seq)
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
    runs = [lambda bound=bound: model.run(bound) for bound in bounds]
    return time_runs(runs, iterations, rounds=rounds, warmup=warmup)


def time_runs(runs: list[Callable[[], object]], iterations: int, *, rounds: int = 5, warmup: int = 3) -> list[float]:
    """Median ms of ``iterations`` calls of each of ``runs``, in ``rounds`` interleaved rounds (:func:`time_calls`)."""
    for run in runs:
        for _ in range(warmup):
            run()
    rounds = max(1, min(rounds, iterations))
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        share = iterations // rounds + (r < iterations % rounds)
        for run, took in zip(runs, times):
            for _ in range(share):
                begin = time.perf_counter()
                run()
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


def head_feeds(manifest, spec, head_graph) -> dict[str, np.ndarray]:
    """Inputs of one head call of ``spec``: every row live, ending at TIMED_POSITION as the target's timed calls."""
    from qspec.runtime.heads import head_proposer

    rng = np.random.default_rng(0)
    rows, seq = spec.batch_size, spec.seq_len
    hidden = rng.standard_normal((rows, seq, manifest.hidden_size)).astype(np.float32)  # [rows, seq_len, hidden]
    start = max(0, min(TIMED_POSITION, spec.ctx_len) - seq)
    return head_proposer(manifest.method).call_feeds(manifest, spec, hidden, start=start, token=1)


def head_shape_name(manifest, index: int, spec) -> str:
    """``prefill``, ``seq_len=1`` (EAGLE's chain step and one-pair catch-up), ``seq_len=5`` (a catch-up
    width), or ``batch=4`` (Medusa)."""
    from qspec.runtime.heads import head_proposer

    if not head_proposer(manifest.method).chained:
        return f"batch={spec.batch_size}"
    return "prefill" if index == 0 else f"seq_len={spec.seq_len}"


def head_micro_benchmark(
    package,
    iterations: int,
    bandwidth: float,
    *,
    batch: int,
    weight_format: str,
    target: MicroPackage | None = None,
    num_threads: int | None = None,
) -> MicroHead:
    """One row per specialization of ``package``'s draft head, the way the runtime runs it (its own session, its
    KV bound in place), beside ``target``'s K=0 call (the package's micro-benchmark) when given."""
    from qspec.head_manifest import read_head_manifest
    from qspec.runtime.head_graph import HeadGraph

    manifest = read_head_manifest(package)
    rows = manifest.full_batch_size or 1
    graph = HeadGraph(
        manifest.path(package, manifest.runtime_graph), rows=rows, kv=manifest.kv_shape, num_threads=num_threads
    )
    specs = list(manifest.specializations)
    feeds = [head_feeds(manifest, spec, graph) for spec in specs]
    timed = time_runs([lambda f=f: graph.run(f) for f in feeds], iterations)
    floor_ms = manifest.runtime_graph_bytes / bandwidth * 1000
    calls = [
        MicroCall(
            specialization=head_shape_name(manifest, i, spec),
            shape=spec.describe(),
            median_ms=round(ms, 3),
            tokens_per_call=spec.batch_size * spec.seq_len,
            ratio_to_floor=round(ms / floor_ms, 2) if floor_ms else 0.0,
        )
        for i, (spec, ms) in enumerate(zip(specs, timed))
    ]
    k0 = next((c.median_ms for c in target.calls if c.specialization.split("@")[0] == "K=0"), None) if target else None
    return MicroHead(
        batch=batch,
        weight_format=weight_format,
        method=manifest.method,
        package=str(package),
        weight_bytes=manifest.runtime_graph_bytes,
        floor_ms=round(floor_ms, 3),
        iterations=iterations,
        target_k0_ms=k0,
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


# The micro phase ---------------------------------------------------------------------------------


def loaded_models(packages: dict[tuple[str, int], Path], num_threads: int | None) -> dict[tuple[str, int], Any]:
    """The packages loaded in this process, once, for the micro-benchmark and the head replays (the timed
    rounds run in each package's worker process; these stay idle meanwhile); (weight format, max batch size)
    -> CompiledModel."""
    from qspec.runtime.model import CompiledModel

    return {key: CompiledModel(package, num_threads=num_threads) for key, package in packages.items()}


def run_micro(
    models: dict, options: BenchOptions, prompts: list[list[int]], steps: Steps, rounds: int = 2
) -> MicroReport | None:
    """One call per specialization of every loaded package, against the bandwidth floor of its weight
    format; then TTFT per prefill chunk size on every batch-1 package (``options.chunk_sizes`` that it
    takes, and its own).

    ``models``: (weight format, max batch size) -> loaded model.
    """
    iterations = options.micro_iterations
    if not iterations:
        return None
    bandwidth = copy_bandwidth()
    packages = []
    prefill = []
    heads = []
    for (weight_format, batch), model in models.items():
        steps.say(f"micro-benchmark, {weight_format} batch {batch}")
        packages.append(micro_benchmark(model, iterations, bandwidth, batch=batch, weight_format=weight_format))
        if has_head(model.package):
            steps.say(f"micro-benchmark, {weight_format} batch {batch}: the draft head")
            heads.append(
                head_micro_benchmark(
                    model.package,
                    iterations,
                    bandwidth,
                    batch=batch,
                    weight_format=weight_format,
                    target=packages[-1],
                    num_threads=options.num_threads,
                )
            )
        if weight_format == "fp32" and batch == 1 and len(model.decode_buckets) > 1 and model.manifest.vendor_graph:
            # The buckets bound what the vendor graph's attention reads; the runtime graph's
            # GroupQueryAttention reads only up to each row's position whatever the bucket.
            from qspec.runtime.model import CompiledModel

            vendor = CompiledModel(model.package, vendor_graph=True)
            packages.append(micro_benchmark(vendor, iterations, bandwidth, batch=1, graph="vendor"))
            del vendor
        if batch == 1 and options.chunk_sizes and model.manifest.runtime_graph is not None:
            steps.say(f"TTFT per prefill chunk size, {weight_format}")
            longest = min(b or model.ctx_len for b in model.prefill_buckets)  # what the package takes
            own = model.prefill_spec.seq_len
            prefill += prefill_sweep(
                model.package,
                prompts,
                sorted({own, *(n for n in options.chunk_sizes if n <= longest)}),
                weight_format=weight_format,
                rounds=rounds,
                num_threads=options.num_threads,
            )
        steps.step(f"micro-benchmark, {weight_format} batch {batch} done")
    return MicroReport(
        copy_bandwidth_gb_s=round(bandwidth / 1e9, 2),
        packages=packages,
        prefill=prefill,
        prefill_prompts=len(prompts) if prefill else 0,
        prefill_rounds=rounds if prefill else 0,
        heads=heads,
    )
