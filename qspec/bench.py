"""``qspec bench``: qspec's speculative configurations against no speculation and transformers, in one run.

What one run does, in order:

1. **Packages**: given a model (``.gguf`` or a Hugging Face folder) it compiles, through the export
   cache, one package per max batch size with every K of every K list (plus 0): batch 1 is a plain
   ``batch_size=1`` package, batch B > 1 a continuous-batching one with ``full_batch_size=B``. A
   configuration restricts the engine to its own Ks (``Engine(num_speculative_tokens=...)``), so
   ``none``, ``pld[4]`` and ``pld[0,4]`` all run on the same loaded weights. One more package with
   K=0 only is compiled for the memory comparison (1 vs 5 specializations).
2. **Micro-benchmark**: the median time of one call per specialization, against the
   memory-bandwidth floor ``weight bytes / copy bandwidth`` (numpy copy, read + write bytes counted).
3. **Timed rounds**: the prompts are cut into rounds of ``round_size``; every round runs every
   configuration, the order rotated by one each round, so machine drift hits all of them alike.
   At batch 1 each prompt is its own ``generate`` call (TTFT without queueing); at batch B the
   round is one ``generate`` call (continuous batching: TTFT includes the wait for a slot).
   The transformers baselines (``generate(do_sample=False)`` and
   ``generate(prompt_lookup_num_tokens=4)``, batch 1) run in a worker process, so torch's memory
   and threads never sit in the engine's process. Every configuration gets the same token ids.
   With ``turns=2`` a second phase asks each MT-bench follow-up, with ``none``'s first answer fed
   back as the assistant turn.
4. **Memory**: one spawned process per configuration loads its engine, generates a little and
   reports its RSS after loading and its peak.
5. **Checks and targets**: every configuration's greedy tokens against ``none``'s at the same batch
   size (and transformers' against qspec's), then the issue's targets, each with its numbers.

Every configuration-round also records the share of the CPU that *other* processes took
(:class:`CpuMeter`); above 10 % the report says which rounds were hit, since interleaving evens out
slow drift but not a job that starts in the middle of one configuration's round.

``run_bench`` returns the report as a JSON-able dict; ``write_report`` writes ``report.json``,
``report.md`` and ``throughput.png`` (requests/s against batch size, one line per configuration).
Library code never prints: progress goes to the ``progress(message, done, total)`` callback.

Rates: a configuration's requests/s and tokens/s are over the summed wall time of its ``generate``
calls. Per category, requests/s is ``requests / Σ request latency``: the throughput at batch 1, a
per-stream rate at batch B. "Ratio" is always against ``none`` at the same batch size.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from qspec import __version__
from qspec.errors import ConfigError, QSpecError
from qspec.runtime.metrics import RequestMetrics, aggregate
from qspec.specializations import FrozenModel, parse_num_speculative_tokens

Progress = Callable[[str, int, int], None]  # (message, units done, units in total)

MT_BENCH_FILE = Path("shared") / "data" / "mt_bench" / "question.jsonl"
SPECULATIVE_METHODS = ("pld", "suffix", "draft")
HF_GREEDY = "transformers"
HF_LOOKUP = "transformers-pld"
HF_LOOKUP_TOKENS = 4  # prompt_lookup_num_tokens of the transformers baseline
DEFAULT_CATEGORY = "all"
PROBE_MAX_NEW_TOKENS = 32
WORKER_TIMEOUT_S = 3600

# The targets (SmolLM2-135M fp32 on the 2-core machine).
TARGET_CATEGORY_FLOOR = 0.98  # variable K / none on every category, batch 1
TARGET_VARIABLE_SPEEDUP = 1.3  # variable K / none requests/s, batch 1
TARGET_VS_HF_GREEDY = 2.5  # qspec none / transformers greedy tokens/s
TARGET_VS_HF_LOOKUP = 3.0  # qspec variable K / transformers prompt lookup tokens/s
TARGET_MEMORY_RATIO = 1.3  # peak RSS with 5 specializations / with 1


class BenchError(QSpecError):
    """A benchmark step failed (a worker process died, a baseline could not load)."""


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    """``"1,4"``, ``4`` or ``[1, 4]`` as a tuple of ints."""
    if isinstance(value, str):
        try:
            return tuple(int(token) for token in value.split(",") if token.strip())
        except ValueError:
            raise ValueError(f"{what} {value!r}: give comma-separated integers such as 1,4") from None
    if isinstance(value, int):
        return (value,)
    return tuple(value)


class BenchOptions(FrozenModel):
    """What ``qspec bench`` runs; :func:`quick_options` and :func:`full_options` are the presets."""

    prompts: Path | None = None  # JSONL of prompts; None: MT-bench
    per_category: int | None = Field(default=2, ge=1)  # first N prompts of each category; None: all
    turns: int = Field(default=1, ge=1, le=2)
    max_new_tokens: int = Field(default=128, ge=1)
    batch_sizes: tuple[int, ...] = (1, 4)
    methods: tuple[str, ...] = ("pld", "suffix")
    k_lists: tuple[tuple[int, ...], ...] = ((4,), (0, 4), (0, 1, 2, 4, 8))
    baselines: bool = True  # transformers greedy and prompt lookup, batch 1
    memory: bool = True  # peak RSS per configuration, one process each
    micro_iterations: int = Field(default=20, ge=0)  # calls per specialization; 0: no micro-benchmark
    round_size: int = Field(default=8, ge=1)
    ctx_len: int = Field(default=1024, ge=2)
    prefill_seq_len: int = Field(default=32, ge=1)
    draft_package: Path | None = None
    num_threads: int | None = Field(default=None, ge=1)
    packages_dir: Path | None = None  # None: <qspec cache>/bench-packages
    dispatch: Literal["cover", "cost"] = "cover"  # how speculative configurations pick K

    @field_validator("batch_sizes", mode="before")
    @classmethod
    def _parse_batch_sizes(cls, value: Any) -> tuple[int, ...]:
        sizes = _int_list(value, "batch_sizes")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"batch_sizes {value!r}: give sizes >= 1, such as 1,4")
        return tuple(sorted(set(sizes)))

    @field_validator("methods", mode="before")
    @classmethod
    def _parse_methods(cls, value: Any) -> tuple[str, ...]:
        names = [m.strip() for m in value.split(",")] if isinstance(value, str) else list(value)
        names = [m for m in names if m and m != "none"]  # none always runs
        unknown = sorted(set(names) - set(SPECULATIVE_METHODS))
        if unknown:
            raise ValueError(f"methods {unknown}: choose from none, {', '.join(SPECULATIVE_METHODS)}")
        return tuple(dict.fromkeys(names))

    @field_validator("k_lists", mode="before")
    @classmethod
    def _parse_k_lists(cls, value: Any) -> tuple[tuple[int, ...], ...]:
        items = value.split(";") if isinstance(value, str) else list(value)
        try:
            lists = [parse_num_speculative_tokens(item.strip() if isinstance(item, str) else item) for item in items]
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if not lists:
            raise ValueError("k_lists is empty; give K lists such as 4;0,4;0,1,2,4,8")
        return tuple(dict.fromkeys(lists))

    @model_validator(mode="after")
    def _check_combination(self) -> BenchOptions:
        k_max = max(k for ks in self.k_lists for k in ks)
        if k_max + 1 > self.ctx_len:
            raise ValueError(f"K {k_max} needs seq_len {k_max + 1} > ctx_len {self.ctx_len}; lower K or raise ctx_len")
        if "draft" in self.methods and self.draft_package is None:
            raise ValueError("method draft needs draft_package (compile one with `qspec compile --num-layers N`)")
        if self.draft_package is not None and "draft" not in self.methods:
            raise ValueError(f"draft_package {self.draft_package} is given but methods {list(self.methods)} omit draft")
        return self

    @property
    def all_ks(self) -> tuple[int, ...]:
        """Every K a package must hold: the union of the K lists, plus 0 for ``none``."""
        return tuple(sorted({0, *(k for ks in self.k_lists for k in ks)}))


def quick_options(**overrides: Any) -> BenchOptions:
    """The < 20 minute version on a 2-core machine: 2 prompts per category, 128 tokens, batch 1 and 4."""
    return BenchOptions.create(**overrides)


def full_options(**overrides: Any) -> BenchOptions:
    """Every prompt, batch sizes 1, 2, 4, 8, 50 calls per specialization in the micro-benchmark."""
    preset = {"per_category": None, "batch_sizes": (1, 2, 4, 8), "micro_iterations": 50}
    return BenchOptions.create(**(preset | overrides))


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of the set: its turns (MT-bench has two) and its category."""

    id: str
    category: str
    turns: tuple[str, ...]


def default_prompts_path() -> Path:
    """MT-bench's ``question.jsonl`` in ``../shared/data`` of the project (or of the working directory)."""
    env = os.environ.get("QSPEC_MT_BENCH")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd().parent / MT_BENCH_FILE, Path(__file__).resolve().parents[2] / MT_BENCH_FILE]
    candidates.append(Path(__file__).resolve().parent / "data" / "mt_bench" / "question.jsonl")  # shipped copy
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(
        f"MT-bench questions not found (looked for {', '.join(str(p) for p in candidates)}); "
        "give --prompts FILE.jsonl or set QSPEC_MT_BENCH"
    )


def _prompt_from_line(item: Any, number: int, path: Path) -> BenchPrompt:
    if isinstance(item, str):
        return BenchPrompt(str(number), DEFAULT_CATEGORY, (item,))
    if not isinstance(item, dict):
        raise ConfigError(f'{path}:{number}: expected a JSON object with "turns" or "prompt"')
    turns = item.get("turns")
    if turns is None:
        turns = [item.get("prompt") or item.get("text")]
    if not turns or not all(isinstance(t, str) and t for t in turns):
        raise ConfigError(f'{path}:{number}: no "turns" list of strings, "prompt" or "text" string')
    ident = str(item.get("question_id", item.get("id", number)))
    return BenchPrompt(ident, str(item.get("category") or DEFAULT_CATEGORY), tuple(turns))


def load_prompts(path: str | os.PathLike[str], *, per_category: int | None = None) -> list[BenchPrompt]:
    """Prompts of a JSONL file (MT-bench lines, or ``{"prompt": ...}``); the first ``per_category`` of each."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist")
    prompts: list[BenchPrompt] = []
    taken: Counter = Counter()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompt = _prompt_from_line(json.loads(line), number, path)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg}); one JSON object per line") from None
        if per_category is None or taken[prompt.category] < per_category:
            taken[prompt.category] += 1
            prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"prompts file {path} has no prompts")
    return prompts


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """One measured configuration: a method with its K list at a max batch size, or a baseline."""

    method: str  # none, pld, suffix, draft, transformers, transformers-pld
    ks: tuple[int, ...]
    batch: int

    @property
    def name(self) -> str:
        """``none``, ``pld[0,4]``, ``transformers``, ``transformers-pld[4]``: the line in the plot."""
        if self.method in ("none", HF_GREEDY):
            return self.method
        return f"{self.method}[{','.join(map(str, self.ks))}]"

    @property
    def key(self) -> str:
        """``pld[0,4]@1``: name and max batch size."""
        return f"{self.name}@{self.batch}"

    @property
    def baseline(self) -> bool:
        return self.method in (HF_GREEDY, HF_LOOKUP)

    @property
    def variable(self) -> bool:
        return len(self.ks) > 1


def plan_configs(options: BenchOptions, *, draft_slots: int | None = None) -> list[RunConfig]:
    """Every configuration of the run: per batch size ``none`` and method x K list; then the baselines.

    ``draft_slots``: KV slots of the draft package; ``draft`` runs only at batch sizes it can hold.
    """
    configs = []
    for batch in options.batch_sizes:
        configs.append(RunConfig("none", (0,), batch))
        methods = [m for m in options.methods if m != "draft" or draft_slots is None or batch <= draft_slots]
        configs += [RunConfig(m, ks, batch) for m in methods for ks in options.k_lists]
    if options.baselines:
        configs += [RunConfig(HF_GREEDY, (), 1), RunConfig(HF_LOOKUP, (HF_LOOKUP_TOKENS,), 1)]
    return configs


def rotated(items: Sequence, by: int) -> list:
    """``items`` rotated left by ``by``: ``rotated([a, b, c], 1) == [b, c, a]``."""
    if not items:
        return []
    by %= len(items)
    return [*items[by:], *items[:by]]


def rounds(count: int, size: int) -> list[range]:
    """Indices ``0..count-1`` in consecutive rounds of ``size``: ``rounds(5, 2) == [0:2, 2:4, 4:5]``."""
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


# --------------------------------------------------------------------------------------------
# Report math (pure)
# --------------------------------------------------------------------------------------------


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference`` rounded to 3 places; None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return round(value / reference, 3)


def category_rates(requests: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per category: requests, output tokens, Σ latency, and the rates over that latency.

    ``requests``: dicts with ``category``, ``output_tokens`` and ``e2e_s``. Two requests of 2 s
    and 4 s with 10 and 30 tokens give ``requests_per_s = 2 / 6``, ``output_tokens_per_s = 40 / 6``.
    """
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for request in requests:
        groups[request["category"]].append(request)
    table = {}
    for category in sorted(groups):
        items = groups[category]
        latency = sum(r["e2e_s"] for r in items)
        tokens = sum(r["output_tokens"] for r in items)
        table[category] = {
            "requests": len(items),
            "output_tokens": tokens,
            "latency_s": round(latency, 4),
            "requests_per_s": round(len(items) / latency, 4) if latency > 0 else 0.0,
            "output_tokens_per_s": round(tokens / latency, 2) if latency > 0 else 0.0,
        }
    return table


def compare_outputs(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> dict[str, Any]:
    """Requests whose tokens equal the reference's, and where the first mismatches diverge.

    ``{"a": [1, 2, 3]}`` against ``{"a": [1, 2, 4]}`` -> 0 of 1 equal, ``a`` diverges at token 2.
    """
    common = sorted(set(outputs) & set(reference), key=_natural_key)
    mismatches = []
    for rid in common:
        mine, theirs = outputs[rid], reference[rid]
        if mine != theirs:
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            mismatches.append({"request": rid, "first_difference_at": at, "lengths": [len(mine), len(theirs)]})
    return {"equal": len(common) - len(mismatches), "total": len(common), "mismatches": mismatches}


def _natural_key(rid: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in rid.replace("/", " ").split())


# --------------------------------------------------------------------------------------------
# Machine measurements
# --------------------------------------------------------------------------------------------


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second a numpy copy of a large array moves (read + write, best of ``repeats``)."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - begin)
    return 2 * src.nbytes / best


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


def micro_benchmark(model, iterations: int, bandwidth: float) -> dict[str, Any]:
    """One row per specialization of ``model``: median ms and the ratio to the bandwidth floor."""
    weight_bytes = model.weight_bytes()
    floor_ms = weight_bytes / bandwidth * 1000
    calls = []
    for name, bound in [("prefill", model.prefill), *((f"K={k}", model.decode[k]) for k in model.ks)]:
        ms = time_call(model, bound, iterations)
        calls.append(
            {
                "specialization": name,
                "shape": bound.spec.describe(),
                "median_ms": round(ms, 2),
                "tokens_per_call": int(bound.input_ids.size),
                "ratio_to_floor": round(ms / floor_ms, 2),
            }
        )
    return {
        "package": str(model.package),
        "weight_bytes": weight_bytes,
        "floor_ms": round(floor_ms, 2),
        "iterations": iterations,
        "calls": calls,
    }


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e6


def _peak_rss_mb() -> float:
    """This process's peak resident set: ``VmHWM`` (not ``ru_maxrss``, which a child inherits across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6  # kB (KiB) -> MB, as _rss_mb
    except OSError:  # pragma: no cover - not Linux
        pass
    return _rss_mb()


def machine_info() -> dict[str, Any]:
    import onnxruntime
    import psutil

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "qspec": __version__,
    }


class CpuMeter:
    """Share of the machine's CPU that *other* processes used over an interval.

    ``(system busy CPU s - this process tree's CPU s) / (wall s x cores)``: 0 on a quiet machine,
    0.5 when another job kept one of two cores busy. The tree is this process, its live children
    (the transformers worker) and the children it has waited for (the memory probes).
    """

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.cores = psutil.cpu_count() or 1
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        t = self._psutil.cpu_times()
        # Steal: time the hypervisor gave this VM's CPUs to someone else, contention all the same.
        busy = t.user + t.nice + t.system + sum(getattr(t, f, 0.0) for f in ("irq", "softirq", "steal"))
        me = self._psutil.Process()
        own = sum(me.cpu_times()[:4])  # user, system, children_user, children_system
        for child in me.children(recursive=True):
            try:
                own += sum(child.cpu_times()[:2])
            except self._psutil.Error:  # exited between the listing and the read
                pass
        return time.perf_counter(), busy, own

    def restart(self) -> None:
        self._start = self._sample()

    def other_share(self) -> float:
        """Other processes' share since the start (or the last ``restart``), clipped to [0, 1]."""
        now, busy, own = self._sample()
        wall, busy0, own0 = now - self._start[0], self._start[1], self._start[2]
        if wall <= 0:
            return 0.0
        return round(min(1.0, max(0.0, (busy - busy0 - (own - own0)) / (wall * self.cores))), 3)


CONTENTION_NOTE = 0.1  # other processes' CPU share above which the report says the machine was shared


# --------------------------------------------------------------------------------------------
# Worker processes (spawned: a clean interpreter, no inherited threads)
# --------------------------------------------------------------------------------------------


class _Worker:
    """A child interpreter running ``target(conn, *args)`` of this module; messages go over a socket.

    A plain subprocess, not ``multiprocessing``: spawn re-imports the caller's main module (a
    script without a ``__main__`` guard would start itself again), fork would inherit ONNX
    Runtime's threads. The child's stdout is discarded and its stderr kept for error messages.
    """

    def __init__(self, target: str, *args: Any):
        import socket
        import subprocess
        import sys
        import tempfile
        from multiprocessing.connection import Connection

        parent, child = socket.socketpair()
        self.stderr = tempfile.TemporaryFile()
        code = f"from qspec.bench import _worker_main; _worker_main({child.fileno()})"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send((target, args))

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no message"

    def receive(self, what: str) -> Any:
        if not self.conn.poll(WORKER_TIMEOUT_S):
            self.close()
            raise BenchError(f"{what}: no answer from the worker process in {WORKER_TIMEOUT_S} s")
        try:
            answer = self.conn.recv()
        except EOFError:
            self.close()
            raise BenchError(f"{what}: the worker process died (exit code {self.process.returncode}: {self._stderr_tail()})") from None
        if isinstance(answer, dict) and "error" in answer:
            self.close()
            raise BenchError(f"{what}: {answer['error']}")
        return answer

    def ask(self, what: str, message: Any) -> Any:
        self.conn.send(message)
        return self.receive(what)

    def close(self) -> None:
        self.conn.close()
        try:
            self.process.wait(timeout=30)
        except Exception:
            self.process.kill()
            self.process.wait()
        self.stderr.close()


def _worker_main(fd: int) -> None:
    """Entry point of a :class:`_Worker` child: receive ``(target name, args)`` and run it."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    target, args = conn.recv()
    assert target in ("_probe_main", "_hf_main"), f"unknown worker target {target!r}"
    globals()[target](conn, *args)


def _probe_main(
    conn, package: str, method: str, ks: list[int], knobs: dict, prompts: list[list[int]], max_new_tokens: int,
    num_threads: int | None,
) -> None:
    """Child: load one configuration's engine, generate ``prompts``, send RSS after load and peak."""
    try:
        from qspec.runtime import Engine, SamplingParams

        start = _rss_mb()
        engine = Engine(package, method=method, num_speculative_tokens=ks, num_threads=num_threads, **knobs)
        loaded = _rss_mb()
        engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
        conn.send(
            {
                "rss_start_mb": round(start, 1),
                "rss_loaded_mb": round(loaded, 1),
                "rss_after_generate_mb": round(_rss_mb(), 1),
                "peak_rss_mb": round(_peak_rss_mb(), 1),
                "specializations": len(engine.model.bindings),
            }
        )
    except Exception as exc:  # sent to the parent, which raises it as a BenchError
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def _hf_main(conn, model_ref: str, num_threads: int, eos_token_ids: list[int]) -> None:
    """Child: load the transformers model, then answer ``(lookup, prompts, max_new_tokens)`` requests."""
    try:
        import torch
        import transformers
        from transformers.generation.streamers import BaseStreamer

        from qspec.export.loader import load_model, resolve_source

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(num_threads)
        begin = time.perf_counter()
        model, _ = load_model(resolve_source(model_ref))
        forwards = [0]
        model.register_forward_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))

        class FirstToken(BaseStreamer):
            """Notes when the first generated token arrives (the first ``put`` is the prompt)."""

            def __init__(self) -> None:
                self.puts, self.time = 0, 0.0

            def put(self, value) -> None:
                self.puts += 1
                if self.puts == 2:
                    self.time = time.perf_counter()

            def end(self) -> None:
                pass

        def generate(ids: list[int], lookup: bool, max_new_tokens: int) -> dict:
            extra = {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS} if lookup else {}
            streamer = FirstToken()
            forwards[0] = 0
            input_ids = torch.tensor([ids], dtype=torch.long)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos_token_ids,
                    pad_token_id=eos_token_ids[0],
                    streamer=streamer,
                    **extra,
                )
            finish = time.perf_counter()
            tokens = out[0, len(ids) :].tolist()
            return {"tokens": tokens, "start": start, "first": streamer.time or finish, "finish": finish, "forwards": forwards[0]}

        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        conn.send({"load_s": round(time.perf_counter() - begin, 2)} | versions)
        while True:
            message = conn.recv()
            if message == "stop":
                conn.send({"peak_rss_mb": round(_peak_rss_mb(), 1), "rss_mb": round(_rss_mb(), 1)})
                return
            lookup, prompts, max_new_tokens = message
            conn.send([generate(ids, lookup, max_new_tokens) for ids in prompts])
    except Exception as exc:  # sent to the parent, which raises it as a BenchError
        conn.send({"error": f"transformers baseline: {type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def _hf_request(result: dict) -> RequestMetrics:
    """A transformers generation as RequestMetrics: decode calls = forwards after the prefill."""
    tokens = len(result["tokens"])
    calls = max(result["forwards"] - 1, 0)
    metrics = RequestMetrics(arrival=result["start"], first_token_time=result["first"], finish_time=result["finish"])
    metrics.output_tokens = tokens
    metrics.target_calls = calls
    metrics.accepted = max(tokens - 1 - calls, 0)  # tokens beyond one per call came from lookup
    return metrics


# --------------------------------------------------------------------------------------------
# Runners: one generate() per batch-1 prompt, one per round at batch B
# --------------------------------------------------------------------------------------------


@dataclass
class _Request:
    id: str
    category: str
    tokens: list[int]
    text: str
    metrics: RequestMetrics


@dataclass
class _Collected:
    """Everything one configuration produced over the rounds."""

    config: RunConfig
    requests: dict[str, _Request] = field(default_factory=dict)
    walls: list[float] = field(default_factory=list)
    other_cpu: list[float] = field(default_factory=list)  # other processes' CPU share during each round
    calls: Counter = field(default_factory=Counter)


def _engine_on(model, config: RunConfig, knobs: dict[str, Any], dispatch: str = "cover"):
    """An Engine for ``config`` on an already loaded ``CompiledModel`` (weights and KV cache shared)."""
    from qspec.runtime import Engine

    return Engine(
        model.package, method=config.method, num_speculative_tokens=list(config.ks), dispatch=dispatch, model=model, **knobs
    )


def _run_qspec(engine, config: RunConfig, ids: list[list[int]], params) -> tuple[list, float, Counter]:
    """(outputs, wall s, calls) of ``ids`` on ``engine``: one call per prompt at batch 1."""
    groups = [[p] for p in ids] if config.batch == 1 else [ids]
    outputs, wall, calls = [], 0.0, Counter()
    for group in groups:
        outputs += engine.generate(group, params)
        wall += engine.last_metrics.wall_s
        calls.update(engine.last_metrics.calls)
    return [(o.token_ids, o.text, o.metrics) for o in outputs], wall, calls


def _run_hf(worker: _Worker, config: RunConfig, ids: list[list[int]], max_new_tokens: int) -> tuple[list, float, Counter]:
    results = worker.ask(config.key, (config.method == HF_LOOKUP, ids, max_new_tokens))
    metrics = [_hf_request(r) for r in results]
    wall = sum(m.e2e_s for m in metrics)
    calls = Counter(prefill=len(results), forward=sum(r["forwards"] for r in results))
    return [(r["tokens"], "", m) for r, m in zip(results, metrics)], wall, calls


# --------------------------------------------------------------------------------------------
# Summaries, checks, targets
# --------------------------------------------------------------------------------------------


def summarize(collected: _Collected) -> dict[str, Any]:
    """Overall metrics (``EngineMetrics`` fields, calls per K) and the per-category table."""
    requests = list(collected.requests.values())
    overall = aggregate([r.metrics for r in requests], sum(collected.walls), dict(collected.calls)).to_dict()
    if collected.config.baseline:
        overall["acceptance_rate"] = None  # transformers does not say how many tokens it proposed
    rows = [{"category": r.category, "output_tokens": r.metrics.output_tokens, "e2e_s": r.metrics.e2e_s} for r in requests]
    config = collected.config
    return {
        "key": config.key,
        "name": config.name,
        "method": config.method,
        "ks": list(config.ks),
        "batch": config.batch,
        "backend": "transformers" if config.baseline else "qspec",
        "overall": overall,
        "per_category": category_rates(rows),
        "round_walls_s": [round(w, 3) for w in collected.walls],
        "round_other_cpu": collected.other_cpu,
    }


def add_ratios(summaries: list[dict[str, Any]]) -> None:
    """Set ``ratio_to_none`` (requests/s, overall and per category) against ``none`` at the same batch."""
    nones = {s["batch"]: s for s in summaries if s["method"] == "none"}
    for s in summaries:
        none = nones.get(s["batch"])
        if none is None:
            continue
        s["overall"]["ratio_to_none"] = ratio(s["overall"]["requests_per_s"], none["overall"]["requests_per_s"])
        for category, row in s["per_category"].items():
            ref = none["per_category"].get(category, {}).get("requests_per_s")
            row["ratio_to_none"] = ratio(row["requests_per_s"], ref)


def equality_checks(collected: dict[str, _Collected]) -> dict[str, Any]:
    """Greedy tokens of every configuration against ``none`` at its batch size (baselines: at batch 1).

    ``speculative_equal_none`` is the headline: every speculative configuration reproduced
    ``none`` token for token. Batch B against batch 1 and transformers against qspec are reported
    too; float sums in another order may flip a near-tie there, so they are information, not a gate.
    """
    tokens = {key: {rid: r.tokens for rid, r in c.requests.items()} for key, c in collected.items()}
    nones = {c.config.batch: key for key, c in collected.items() if c.config.method == "none"}
    first_none = nones[min(nones)]
    checks = []
    for key, c in collected.items():
        if c.config.method == "none":
            if key != first_none:
                check = compare_outputs(tokens[key], tokens[first_none])
                checks.append({"config": key, "reference": first_none, "kind": "batch"} | check)
            continue
        reference = first_none if c.config.baseline else nones[c.config.batch]
        kind = "baseline" if c.config.baseline else "speculative"
        checks.append({"config": key, "reference": reference, "kind": kind} | compare_outputs(tokens[key], tokens[reference]))
    speculative = [c for c in checks if c["kind"] == "speculative"]
    return {
        "speculative_equal_none": all(c["equal"] == c["total"] for c in speculative),
        "all_equal": all(c["equal"] == c["total"] for c in checks),
        "checks": checks,
    }


def contention_notes(other_cpu: float, summaries: list[dict[str, Any]]) -> list[str]:
    """A note when other processes used more than CONTENTION_NOTE of the CPU, with the worst rounds."""
    rounds_hit = [
        (share, s["key"], number + 1)
        for s in summaries
        for number, share in enumerate(s.get("round_other_cpu", []))
        if share > CONTENTION_NOTE
    ]
    if other_cpu <= CONTENTION_NOTE and not rounds_hit:
        return []
    worst = ", ".join(f"{key} round {n}: {share:.0%}" for share, key, n in sorted(rounds_hit, reverse=True)[:4])
    return [
        f"other processes used {other_cpu:.0%} of the CPU over the run"
        + (f" (worst: {worst}; {len(rounds_hit)} config-rounds above {CONTENTION_NOTE:.0%})" if rounds_hit else "")
        + ": the machine was shared, so these numbers, ratios included, are not clean; rerun on a quiet machine"
    ]


def _target(name: str, goal: str, measured: str, passed: bool | None) -> dict[str, Any]:
    return {"target": name, "goal": goal, "measured": measured, "status": "n/a" if passed is None else ("PASS" if passed else "MISS")}


def _at_least(name: str, value: float | None, goal: float, *, suffix: str = "", digits: int = 2, missing: str = "not run"):
    """A ``>= goal x`` target on a ratio that may be missing (configuration not run)."""
    measured = f"{value:.{digits}f} x" if value is not None else missing
    return _target(name, f">= {goal} x{suffix}", measured, value >= goal if value is not None else None)


def evaluate_targets(summaries: list[dict[str, Any]], memory: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The issue's targets, each with PASS / MISS / n/a and the numbers behind it."""
    by_key = {s["key"]: s for s in summaries}
    targets = []
    variable = [s for s in summaries if s["backend"] == "qspec" and len(s["ks"]) > 1]
    fixed = [s for s in summaries if s["backend"] == "qspec" and s["method"] != "none" and len(s["ks"]) == 1]
    for s in [s for s in variable if s["batch"] == 1]:
        ratios = {c: row.get("ratio_to_none") for c, row in s["per_category"].items() if row.get("ratio_to_none") is not None}
        worst = min(ratios, key=ratios.get) if ratios else None
        targets.append(
            _target(
                f"{s['name']} vs none per category (batch 1)",
                f">= {TARGET_CATEGORY_FLOOR} x none on every category",
                f"lowest {ratios[worst]:.3f} x ({worst})" if worst else "no categories",
                ratios[worst] >= TARGET_CATEGORY_FLOOR if worst else None,
            )
        )
    for s in variable:
        for f in [f for f in fixed if f["method"] == s["method"] and f["batch"] == s["batch"]]:
            pairs = {"overall": ratio(s["overall"]["requests_per_s"], f["overall"]["requests_per_s"])}
            if s["batch"] == 1:  # per category, requests/s is a throughput at batch 1 only
                for c, row in s["per_category"].items():
                    pairs[c] = ratio(row["requests_per_s"], f["per_category"].get(c, {}).get("requests_per_s"))
            pairs = {k: v for k, v in pairs.items() if v is not None}
            worst = min(pairs, key=pairs.get)
            targets.append(
                _target(
                    f"{s['key']} vs {f['key']}",
                    ">= fixed K overall" + (" and on every category" if s["batch"] == 1 else ""),
                    f"lowest {pairs[worst]:.3f} x ({worst})",
                    pairs[worst] >= 1.0,
                )
            )
    for s in [s for s in variable if s["batch"] == 1]:
        value = s["overall"].get("ratio_to_none")
        targets.append(
            _at_least(
                f"{s['name']} vs none, requests/s (batch 1)",
                value,
                TARGET_VARIABLE_SPEEDUP,
                suffix=" none",
                digits=3,
                missing="no none run",
            )
        )
    none, hf, hf_pld = by_key.get("none@1"), by_key.get(f"{HF_GREEDY}@1"), by_key.get(f"{HF_LOOKUP}[{HF_LOOKUP_TOKENS}]@1")
    value = ratio(none["overall"]["output_tokens_per_s"], hf["overall"]["output_tokens_per_s"]) if none and hf else None
    targets.append(_at_least("qspec none vs transformers greedy, tokens/s", value, TARGET_VS_HF_GREEDY))
    for s in [s for s in variable if s["batch"] == 1 and s["method"] == "pld"]:
        value = ratio(s["overall"]["output_tokens_per_s"], hf_pld["overall"]["output_tokens_per_s"]) if hf_pld else None
        targets.append(_at_least(f"qspec {s['name']} vs transformers prompt lookup, tokens/s", value, TARGET_VS_HF_LOOKUP))
    value = (memory or {}).get("ratio")
    targets.append(
        _target(
            f"peak RSS, {(memory or {}).get('many_label', '5 specializations')} / 1",
            f"<= {TARGET_MEMORY_RATIO} x",
            f"{value:.3f} x ({memory['many_peak_mb']:.0f} / {memory['one_peak_mb']:.0f} MB)" if value else "not measured",
            value <= TARGET_MEMORY_RATIO if value else None,
        )
    )
    return targets


# --------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------


def _package_name(model: str, batch: int, ks: Sequence[int], options: BenchOptions) -> str:
    stem = Path(str(model).rstrip("/")).name.removesuffix(".gguf")
    return f"{stem}-b{batch}-k{'_'.join(map(str, ks))}-ctx{options.ctx_len}-p{options.prefill_seq_len}"


def _compile(model: str, batch: int, ks: Sequence[int], options: BenchOptions, root: Path) -> Path:
    """A package for ``batch`` with ``ks`` (continuous batching above batch 1), reused when unchanged."""
    from qspec.compile import CompileOptions, compile_package
    from qspec.specializations import make_config

    spec = make_config(
        num_speculative_tokens=list(ks),
        ctx_len=options.ctx_len,
        prefill_seq_len=options.prefill_seq_len,
        full_batch_size=batch if batch > 1 else None,
    )
    output = root / _package_name(model, batch, ks, options)
    folder, _, _ = compile_package(model, CompileOptions.create(specialization=spec), output=output)
    return folder


def _is_package(path: Path) -> bool:
    from qspec.package import MANIFEST

    return (path / MANIFEST).is_file()


class _Bench:
    """One run's state; :func:`run_bench` is its public face."""

    def __init__(self, model: str, options: BenchOptions, progress: Progress | None):
        self.model = model
        self.options = options
        self.say = progress or (lambda message, done, total: None)
        self.done = 0
        self.total = 1
        self.notes: list[str] = []

    def step(self, message: str, units: int = 1) -> None:
        self.done += units
        self.say(message, self.done, self.total)

    # -- setup ----------------------------------------------------------------------------

    def resolve(self) -> None:
        """Packages per batch size (compiled from the model, or the one package given) and the source."""
        options = self.options
        given = Path(self.model)
        if given.is_dir() and _is_package(given):
            from qspec.package import read_manifest

            manifest = read_manifest(given)
            rows = manifest.config.full_batch_size or manifest.config.batch_size
            have = set(manifest.config.num_speculative_tokens)
            if 0 not in have:
                raise ConfigError(
                    f"package {given} has no K=0 (it has {sorted(have)}); `none` needs it: recompile with 0 in the K list"
                )
            k_lists = tuple(ks for ks in options.k_lists if set(ks) <= have)
            if not k_lists:
                raise ConfigError(f"none of the K lists {list(options.k_lists)} is compiled in {given} (it has {sorted(have)})")
            dropped = [ks for ks in options.k_lists if ks not in k_lists]
            if dropped or options.batch_sizes != (rows,):
                self.notes.append(f"a package was given: batch size {rows} only, K lists {[list(k) for k in k_lists]}")
            self.options = options = options.model_copy(update={"batch_sizes": (rows,), "k_lists": k_lists})
            self.packages_given = {rows: given}
            self.source = manifest.model.source if Path(manifest.model.source).exists() else None
        else:
            from qspec.export.loader import resolve_source

            resolve_source(self.model)  # a clear error for a path that is no model, before any work
            self.packages_given = None
            self.source = self.model
        if options.baselines and self.source is None:
            raise ConfigError(
                "the transformers baselines need the model the package was compiled from, which is not at hand; "
                "pass --no-baselines or give the model instead of the package"
            )
        if options.baselines:
            import importlib.util

            if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
                raise ConfigError(
                    "the transformers baselines need torch and transformers (pip install 'qspec[export]'); "
                    "or pass --no-baselines"
                )
        draft_slots = None
        if options.draft_package is not None:
            from qspec.package import read_manifest

            draft = read_manifest(options.draft_package).config
            draft_slots = draft.full_batch_size or draft.batch_size
            skipped = [b for b in options.batch_sizes if b > draft_slots]
            if skipped:
                self.notes.append(f"draft runs at batch sizes <= {draft_slots} only (the draft package's KV slots), not at {skipped}")
        self.configs = plan_configs(options, draft_slots=draft_slots)
        prompts = load_prompts(options.prompts or default_prompts_path(), per_category=options.per_category)
        if options.turns == 2:
            if not any(len(p.turns) >= 2 for p in prompts):
                raise ConfigError("turns=2 needs prompts with two turns (MT-bench's \"turns\"); these have one")
        self.prompts = prompts

    def plan_units(self) -> None:
        options = self.options
        qspec_configs = [c for c in self.configs if not c.baseline]
        packages = len(options.batch_sizes) + (1 if options.memory and self.packages_given is None else 0)
        turn2 = sum(1 for p in self.prompts if len(p.turns) >= 2) if options.turns == 2 else 0
        round_count = len(rounds(len(self.prompts), options.round_size)) + len(rounds(turn2, options.round_size))
        self.total = (
            packages  # compile
            + len(options.batch_sizes)  # load
            + (1 if options.baselines else 0)  # transformers load
            + (len(options.batch_sizes) if options.micro_iterations else 0)
            + round_count * len(self.configs)
            + ((len(qspec_configs) + 1) if options.memory else 0)
            + 1  # summaries
        )

    def compile_packages(self) -> None:
        options = self.options
        self.packages: dict[int, Path] = {}
        self.one_spec_package: Path | None = None
        if self.packages_given is not None:
            self.packages = dict(self.packages_given)
            return
        from qspec.export.exporter import cache_root

        root = options.packages_dir or cache_root() / "bench-packages"
        for batch in options.batch_sizes:
            self.say(f"compiling the batch {batch} package (K {list(options.all_ks)})", self.done, self.total)
            self.packages[batch] = _compile(self.model, batch, options.all_ks, options, root)
            self.step(f"package for batch {batch} ready")
        if options.memory:
            self.say("compiling the 1-specialization package for the memory comparison", self.done, self.total)
            self.one_spec_package = _compile(self.model, 1, (0,), options, root)
            self.step("1-specialization package ready")

    def load_engines(self) -> None:
        from qspec.runtime.model import CompiledModel

        self.models = {}
        self.engines = {}
        for batch, package in self.packages.items():
            self.say(f"loading the batch {batch} package", self.done, self.total)
            model = CompiledModel(package, num_threads=self.options.num_threads)
            self.models[batch] = model
            for config in [c for c in self.configs if not c.baseline and c.batch == batch]:
                self.engines[config.key] = _engine_on(model, config, self._knobs(config.method), self.options.dispatch)
            self.step(f"batch {batch} engines ready")
        first = self.engines[self.configs[0].key]
        self.eos_token_ids = sorted(first.eos_token_ids)
        self.encode = lambda messages: first.encode(messages, chat=True)

    def _knobs(self, method: str) -> dict[str, Any]:
        return {"draft_package": self.options.draft_package} if method == "draft" else {}

    def start_baselines(self) -> None:
        self.hf: _Worker | None = None
        self.hf_info: dict[str, Any] = {}
        if not self.options.baselines:
            return
        self.say("loading the transformers model (a worker process)", self.done, self.total)
        threads = self.options.num_threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        self.hf = _Worker("_hf_main", str(self.source), threads, self.eos_token_ids)
        self.hf_info = self.hf.receive("loading the transformers model") | {"threads": threads}
        self.step("transformers model loaded")

    def run_micro(self) -> dict[str, Any] | None:
        if not self.options.micro_iterations:
            return None
        bandwidth = copy_bandwidth()
        packages = []
        for batch, model in self.models.items():
            self.say(f"micro-benchmark, batch {batch}", self.done, self.total)
            packages.append({"batch": batch} | micro_benchmark(model, self.options.micro_iterations, bandwidth))
            self.step(f"micro-benchmark, batch {batch} done")
        return {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 2), "packages": packages}

    # -- timed rounds ----------------------------------------------------------------------

    def run_phase(self, requests: list[tuple[str, str, list[int]]], collected: dict[str, _Collected], turn: int) -> None:
        """Every configuration on every round of ``requests`` (id, category, token ids), order rotated."""
        from qspec.runtime import SamplingParams

        params = SamplingParams(max_new_tokens=self.options.max_new_tokens)
        for number, indices in enumerate(rounds(len(requests), self.options.round_size)):
            batch = [requests[i] for i in indices]
            ids = [r[2] for r in batch]
            for config in rotated(self.configs, number):
                self.say(f"turn {turn}, round {number + 1}: {config.key}", self.done, self.total)
                meter = CpuMeter()
                if config.baseline:
                    results, wall, calls = _run_hf(self.hf, config, ids, self.options.max_new_tokens)
                else:
                    results, wall, calls = _run_qspec(self.engines[config.key], config, ids, params)
                c = collected[config.key]
                for (rid, category, _), (tokens, text, metrics) in zip(batch, results):
                    c.requests[rid] = _Request(rid, category, list(tokens), text, metrics)
                c.walls.append(wall)
                c.other_cpu.append(meter.other_share())
                c.calls.update(calls)
                self.step(f"turn {turn}, round {number + 1}: {config.key} done")

    def run_timed(self) -> dict[str, _Collected]:
        collected = {c.key: _Collected(c) for c in self.configs}
        first = [(p.id, p.category, self.encode([{"role": "user", "content": p.turns[0]}])) for p in self.prompts]
        self.run_phase(first, collected, 1)
        if self.options.turns == 2:
            answers = collected[f"none@{self.options.batch_sizes[0]}"].requests
            second = []
            for p in [p for p in self.prompts if len(p.turns) >= 2]:
                messages = [
                    {"role": "user", "content": p.turns[0]},
                    {"role": "assistant", "content": answers[p.id].text},
                    {"role": "user", "content": p.turns[1]},
                ]
                second.append((f"{p.id}/2", p.category, self.encode(messages)))
            self.run_phase(second, collected, 2)
        return collected

    # -- memory ----------------------------------------------------------------------------

    def run_memory(self) -> dict[str, Any] | None:
        if not self.options.memory:
            return None
        probes: dict[str, dict[str, Any]] = {}
        prompt_ids = [self.encode([{"role": "user", "content": p.turns[0]}]) for p in self.prompts]
        max_new = min(self.options.max_new_tokens, PROBE_MAX_NEW_TOKENS)
        jobs = [
            (c.key, self.packages[c.batch], c.method, list(c.ks), self._knobs(c.method), prompt_ids[: c.batch])
            for c in self.configs
            if not c.baseline
        ]
        if self.one_spec_package is not None:
            jobs.append(("none@1 (K=0 package)", self.one_spec_package, "none", [0], {}, prompt_ids[:1]))
        for key, package, method, ks, knobs, prompts in jobs:
            self.say(f"memory: {key} in its own process", self.done, self.total)
            worker = _Worker("_probe_main", str(package), method, ks, knobs, prompts, max_new, self.options.num_threads)
            try:
                probes[key] = worker.receive(f"memory probe {key}")
            finally:
                worker.close()
            self.step(f"memory: {key} done")
        return {"probe_prompts_max_new_tokens": max_new, "probes": probes} | self._memory_ratio(probes)

    def _memory_ratio(self, probes: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Peak RSS of the batch-1 engine that runs the most specializations against the K=0 package."""
        one = probes.get("none@1 (K=0 package)")
        candidates = [c for c in self.configs if c.batch == 1 and not c.baseline and c.key in probes]
        if one is None or not candidates:
            return {}
        many = max(candidates, key=lambda c: (len(c.ks), c.method != "none"))
        peak = probes[many.key]["peak_rss_mb"]
        none = probes.get("none@1", {}).get("peak_rss_mb")
        decode_specs = probes[many.key]["specializations"] - 1
        return {
            "one_peak_mb": one["peak_rss_mb"],
            "many_peak_mb": peak,
            "many_config": many.key,
            "many_label": f"{decode_specs} decode specializations ({many.key})",
            "ratio": ratio(peak, one["peak_rss_mb"]),
            "none_ratio": ratio(none, one["peak_rss_mb"]),  # same method, only the package differs
        }

    def stop_baselines(self) -> dict[str, Any]:
        if self.hf is None:
            return {}
        try:
            return self.hf.ask("stopping the transformers worker", "stop")
        finally:
            self.hf.close()


def run_bench(
    model: str | os.PathLike[str], options: BenchOptions | None = None, *, progress: Progress | None = None
) -> dict[str, Any]:
    """Run the benchmark of ``model`` (a ``.gguf``, a Hugging Face folder or a compiled package).

    Returns the report (JSON-able); :func:`write_report` writes it out. Raises a QSpecError
    subclass (one line, with the fix) for bad options and failed steps.
    """
    options = options or quick_options()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    begin = time.perf_counter()
    meter = CpuMeter()
    bench = _Bench(str(model), options, progress)
    phases: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = round(now - mark, 1)
        mark = now

    bench.resolve()
    bench.plan_units()
    bench.compile_packages()
    lap("compile_s")
    bench.load_engines()
    try:
        bench.start_baselines()
        lap("load_s")
        micro = bench.run_micro()
        lap("micro_s")
        collected = bench.run_timed()
        lap("timed_rounds_s")
        hf_stop = bench.stop_baselines()
    except BaseException:
        if getattr(bench, "hf", None) is not None:
            bench.hf.close()
        raise
    memory = bench.run_memory()
    lap("memory_s")
    summaries = [summarize(c) for c in collected.values()]
    add_ratios(summaries)
    if memory:
        for s in summaries:
            probe = memory["probes"].get(s["key"])
            s["overall"]["peak_rss_mb"] = probe["peak_rss_mb"] if probe else None
    for s in summaries:
        if s["backend"] == "transformers":
            s["overall"]["peak_rss_mb"] = hf_stop.get("peak_rss_mb")
    equality = equality_checks(collected)
    other_cpu = meter.other_share()
    notes = list(bench.notes) + contention_notes(other_cpu, summaries)
    bench.step("report ready")
    return {
        "meta": {
            "model": str(model),
            "packages": {str(b): str(p) for b, p in bench.packages.items()},
            "started": started,
            "wall_s": round(time.perf_counter() - begin, 1),
            "phases": phases,
            "options": json.loads(bench.options.model_dump_json()),
            "prompts": len(bench.prompts),
            "categories": sorted({p.category for p in bench.prompts}),
            "machine": machine_info() | {"other_processes_cpu_share": other_cpu},
            "transformers": bench.hf_info,
            "notes": notes,
        },
        "configs": summaries,
        "micro": micro,
        "memory": memory,
        "equality": equality,
        "targets": evaluate_targets(summaries, memory),
        "outputs": {key: {rid: r.tokens for rid, r in c.requests.items()} for key, c in collected.items()},
    }


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(v) if not isinstance(v, str) else v for v in row) + " |" for row in rows]
    return lines


def _calls_per_k(calls: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in calls.items() if k != "prefill" and v)


def render_markdown(report: dict[str, Any]) -> str:
    """``report.md``: the tables of the report."""
    meta = report["meta"]
    options = meta["options"]
    machine = meta["machine"]
    hf = meta["transformers"]
    baseline_versions = f", torch {hf.get('torch')}, transformers {hf.get('transformers')}" if hf else ""
    lines = [
        "# qspec bench",
        "",
        f"Model `{meta['model']}`; {meta['prompts']} prompts ({', '.join(meta['categories'])}), "
        f"turns {options['turns']}, max_new_tokens {options['max_new_tokens']}, ctx_len {options['ctx_len']}, "
        f"greedy. Started {meta['started']}, {meta['wall_s']} s in all ("
        + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v} s" for k, v in meta.get("phases", {}).items()) + ").",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gb']} GB; onnxruntime "
        f"{machine['onnxruntime']}{baseline_versions}.",
        "Rates are over each configuration's summed `generate` wall time; the configurations ran interleaved "
        "round by round. Ratio: requests/s against `none` at the same max batch size. TTFT at batch > 1 includes "
        "the wait for a slot. Other CPU: the share of the machine other processes used while a configuration ran.",
    ]
    lines += [f"> Note: {note}" for note in meta["notes"]]
    equality = report["equality"]
    lines += ["", "## Greedy outputs", ""]
    verdict = "equal" if equality["speculative_equal_none"] else "NOT equal"
    lines.append(f"Every speculative configuration's greedy output is **{verdict}** to `none`'s at the same batch size.")
    lines += [""] + _table(
        ["config", "reference", "kind", "equal", "first mismatches (request@token)"],
        [
            [c["config"], c["reference"], c["kind"], f"{c['equal']}/{c['total']}",
             ", ".join(f"{m['request']}@{m['first_difference_at']}" for m in c["mismatches"][:5]) or "–"]
            for c in equality["checks"]
        ],
    )
    lines += ["", "## Targets", ""] + _table(
        ["target", "goal", "measured", "status"], [[t["target"], t["goal"], t["measured"], t["status"]] for t in report["targets"]]
    )
    lines += ["", "## Per configuration", ""]
    rows = []
    for s in report["configs"]:
        o = s["overall"]
        rows.append([
            s["key"], o["requests_per_s"], o["output_tokens_per_s"], o["ttft_ms_median"], o["tpot_ms_median"],
            o["mean_accepted_tokens"], o["acceptance_rate"], _calls_per_k(o["calls"]),
            _fmt(o.get("peak_rss_mb"), 0), _fmt(o.get("ratio_to_none"), 3),
            f"{max(s.get('round_other_cpu') or [0]):.0%}",
        ])
    lines += _table(
        ["config@batch", "req/s", "out tok/s", "TTFT ms (median)", "TPOT ms (median)", "tokens/call", "acceptance",
         "calls per K", "peak RSS MB", "x none", "other CPU (worst round)"],
        rows,
    )
    for batch in options["batch_sizes"]:
        group = [s for s in report["configs"] if s["batch"] == batch]
        categories = sorted({c for s in group for c in s["per_category"]})
        lines += ["", f"## Per category, batch {batch}", "",
                  "requests / Σ latency (" + ("the throughput" if batch == 1 else "a per-stream rate") + "), and × none", ""]
        rows = []
        for category in categories:
            row = [category]
            for s in group:
                cell = s["per_category"].get(category)
                row.append("–" if cell is None else f"{cell['requests_per_s']:.3f} ({_fmt(cell.get('ratio_to_none'), 2)}×)")
            rows.append(row)
        lines += _table(["category", *(s["name"] for s in group)], rows)
    micro = report.get("micro")
    if micro:
        lines += ["", "## One call per specialization", "",
                  f"Copy bandwidth {micro['copy_bandwidth_gb_s']} GB/s (numpy copy, read + write counted); "
                  "floor = weight bytes / bandwidth.", ""]
        rows = []
        for p in micro["packages"]:
            for c in p["calls"]:
                rows.append([
                    p["batch"], c["specialization"], c["shape"], c["tokens_per_call"], c["median_ms"], p["floor_ms"],
                    c["ratio_to_floor"],
                ])
        lines += _table(["batch", "specialization", "shape", "tokens/call", "median ms", "floor ms", "x floor"], rows)
    memory = report.get("memory")
    if memory:
        lines += ["", "## Memory", "",
                  f"Each configuration in its own process: load, generate {memory['probe_prompts_max_new_tokens']} tokens per prompt "
                  "(batch-size prompts), RSS after load and peak.", ""]
        rows = [
            [key, p["specializations"], p["rss_loaded_mb"], p["rss_after_generate_mb"], p["peak_rss_mb"]]
            for key, p in memory["probes"].items()
        ]
        lines += _table(["config", "specializations", "RSS loaded MB", "RSS after generate MB", "peak RSS MB"], rows)
        if memory.get("ratio"):
            lines += ["", f"Peak RSS with {memory['many_label']}: {memory['many_peak_mb']:.0f} MB, "
                          f"{memory['ratio']:.3f} × the K=0 package's {memory['one_peak_mb']:.0f} MB "
                          f"(`none` on both packages: {_fmt(memory.get('none_ratio'), 3)} ×)."]
    return "\n".join(lines) + "\n"


def plot_throughput(report: dict[str, Any], path: Path) -> None:
    """Requests/s against max batch size, one line per configuration (baselines as points at batch 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for s in report["configs"]:
        lines[s["name"]].append((s["batch"], s["overall"]["requests_per_s"]))
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, points in lines.items():
        points.sort()
        xs, ys = zip(*points)
        style = "s--" if name.startswith(HF_GREEDY) else "o-"
        axes.plot(xs, ys, style, label=name)
    batches = sorted({s["batch"] for s in report["configs"]})
    axes.set_xscale("log", base=2)
    axes.set_xticks(batches, [str(b) for b in batches])
    axes.set_xlabel("max batch size")
    axes.set_ylabel("requests/s")
    axes.set_title(f"qspec bench: {Path(report['meta']['model']).name}")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(report: dict[str, Any], folder: str | os.PathLike[str]) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` and ``throughput.png`` into ``folder``; returns their paths."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"output {folder} is a file; give a folder")
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "report.json", "markdown": folder / "report.md", "plot": folder / "throughput.png"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["markdown"].write_text(render_markdown(report))
    plot_throughput(report, paths["plot"])
    return paths
