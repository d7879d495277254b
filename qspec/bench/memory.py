"""Memory: each qspec configuration loaded and run in its own process, RSS after loading and peak.

The headline: peak RSS of the batch-1 engine with the most specializations against a package with
K=0 only (one prefill + one decode specialization): the runtime serves them all from one session.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from qspec.bench.analysis import ratio
from qspec.bench.plan import RunConfig, Steps, engine_config, none_config
from qspec.bench.report import MemoryProbe, MemoryReport
from qspec.bench.workers import Worker
from qspec.runtime.config import EngineConfig
from qspec.runtime.proposers import HEAD_METHODS

PROBE_MAX_NEW_TOKENS = 32
ONE_SPEC_KEY = "none@1 (K=0 package)"


def _probe(key: str, package: Path, config: EngineConfig, prompts: list[list[int]], max_new: int) -> MemoryProbe:
    worker = Worker("probe", str(package), config, prompts, max_new, name=f"memory probe {key}")
    try:
        return MemoryProbe(**worker.receive(f"memory probe {key}"))
    finally:
        worker.close()


def memory_ratio(configs: list[RunConfig], probes: dict[str, MemoryProbe]) -> dict:
    """Peak RSS of the batch-1 engine that runs the most specializations against the K=0 package.

    Both of the primary weight format (the K=0 package's): only the number of specializations differs
    (a head method also loads its head's graph, so it is not the one compared).
    """
    one = probes.get(ONE_SPEC_KEY)
    qspec = [c for c in configs if not c.baseline and c.method not in HEAD_METHODS]
    primary = qspec[0].weight_format if qspec else None
    candidates = [c for c in qspec if c.batch == 1 and c.weight_format == primary and c.key in probes]
    if one is None or not candidates:
        return {}
    many = max(candidates, key=lambda c: (len(c.ks), c.method != "none"))
    peak = probes[many.key].peak_rss_mb
    none = probes.get(none_config(primary, 1).key)
    return {
        "one_peak_mb": one.peak_rss_mb,
        "many_peak_mb": peak,
        "many_config": many.key,
        "many_label": f"{probes[many.key].specializations - 1} decode specializations ({many.key})",
        "ratio": ratio(peak, one.peak_rss_mb),
        "none_ratio": ratio(none.peak_rss_mb if none else None, one.peak_rss_mb),  # only the package differs
    }


def run_memory(
    configs: list[RunConfig],
    packages: dict[tuple[str, int], Path],  # (weight format, max batch size) -> package
    one_spec_package: Path | None,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    num_threads: int | None,
    draft_package: Path | None,
    steps: Steps,
) -> MemoryReport:
    """One probe process per qspec configuration (and for ``none`` on the K=0 package)."""
    max_new = min(max_new_tokens, PROBE_MAX_NEW_TOKENS)
    primary = next(iter(packages))[0]
    engine = partial(engine_config, num_threads=num_threads, draft_package=draft_package)
    jobs = [
        (c.key, packages[c.weight_format, c.batch], engine(c), prompt_ids[: c.batch]) for c in configs if not c.baseline
    ]
    if one_spec_package is not None:
        jobs.append((ONE_SPEC_KEY, one_spec_package, engine(none_config(primary, 1)), prompt_ids[:1]))
    probes = {}
    for key, package, config, prompts in jobs:
        steps.say(f"memory: {key} in its own process")
        probes[key] = _probe(key, package, config, prompts, max_new)
        steps.step(f"memory: {key} done")
    return MemoryReport(probe_prompts_max_new_tokens=max_new, probes=probes, **memory_ratio(configs, probes))
