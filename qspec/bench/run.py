"""The run: plan, compile, load the runners, micro-benchmark, interleaved timed rounds, memory, report.

Every round runs every configuration, the order rotated by one each round, so machine drift hits all
of them alike; configurations at one batch size get the same token ids (at batch > 1 more prompts than
at batch 1, a round's share in one run: ``BenchOptions.batch_per_category``). Each configuration-round also records
the share of the CPU other processes took (:class:`CpuMeter`).
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from dataclasses import dataclass, field, replace

import psutil

from qspec.bench.analysis import Collected, contention_notes, equality_checks, summarize, with_ratios
from qspec.bench.ceiling import HeadReplay, ceilings, head_replays_of
from qspec.bench.machine import CpuMeter, cpu_name, machine_versions, usable_cores
from qspec.bench.memory import run_memory
from qspec.bench.micro import loaded_models, run_micro
from qspec.bench.options import BenchOptions, quick_options
from qspec.bench.packages import Packages, ResolvedModel, compile_packages, package_count, resolve_model
from qspec.bench.peers import PeerPlan, PeerUnavailable, plan_peers
from qspec.bench.plan import (
    TRANSFORMERS,
    Progress,
    RunConfig,
    Steps,
    beside_baselines,
    none_config,
    plan_configs,
    rotated,
    rounds,
)
from qspec.bench.report import BenchReport, MachineInfo, MemoryReport, Meta, MicroReport, RunnerInfo, Skipped
from qspec.bench.runners import QspecRunner, Runner, TransformersRunner
from qspec.errors import ConfigError
from qspec.prompts import PromptRecord, default_prompts_path, load_prompts

Request = tuple[str, str, list[int]]  # (request id, category, prompt token ids)


@dataclass(frozen=True)
class BenchPlan:
    """What a run will do, known before any work: the model, its options, configurations and prompts."""

    model: str
    resolved: ResolvedModel
    configs: list[RunConfig]
    prompts: list[PromptRecord]
    peers: PeerPlan
    batch_prompts: list[PromptRecord]  # the first turns configurations at batch > 1 run (``prompts`` and more)

    @property
    def options(self) -> BenchOptions:
        return self.resolved.options


def make_plan(model: str, options: BenchOptions) -> BenchPlan:
    """Resolve the model, plan the configurations, read the prompts; bad input fails here, before work."""
    resolved = resolve_model(model, options)
    options = resolved.options
    peers = plan_peers(resolved.source, options)
    configs = plan_configs(options, draft_slots=resolved.draft_slots) + peers.configs
    path = options.prompts or default_prompts_path()
    prompts = load_prompts(path, per_category=options.per_category)
    if options.turns == 2 and not any(len(p.turns) >= 2 for p in prompts):
        raise ConfigError('turns=2 needs prompts with two turns (MT-bench\'s "turns"); these have one')
    batch_prompts = prompts
    if any(c.batch > 1 for c in configs) and options.per_category is not None:
        wanted = options.batch_per_category
        batch_prompts = load_prompts(path, per_category=None if wanted is None else max(wanted, options.per_category))
    return BenchPlan(model, resolved, configs, prompts, peers, batch_prompts)


def round_count(plan: BenchPlan) -> int:
    """Rounds each configuration runs: turn 1's, plus the follow-ups' with ``turns=2``."""
    options = plan.options
    turn2 = sum(1 for p in plan.prompts if len(p.turns) >= 2) if options.turns == 2 else 0
    return len(rounds(len(plan.prompts), options.round_size)) + len(rounds(turn2, options.round_size))


def count_units(plan: BenchPlan) -> int:
    """Units of progress of the whole run (one per package, load, round of a configuration, probe)."""
    options = plan.options
    qspec_configs = [c for c in plan.configs if not c.baseline]
    loaded = package_count(options) if plan.resolved.given is None else 1
    packages = loaded + (1 if options.memory and plan.resolved.given is None else 0)
    return (
        packages
        + loaded  # load
        + len({c.backend for c in plan.configs if c.baseline})  # baseline loads
        + (loaded if options.analysis and options.micro_iterations else 0)
        + round_count(plan) * len(plan.configs)
        + ((len(qspec_configs) + 1) if options.memory else 0)
        + 1  # summaries
    )


def baseline_runners(plan: BenchPlan, eos_token_ids: list[int]) -> list[Runner]:
    """A runner for every baseline backend the plan holds: transformers, then the peers (:mod:`.peers`)."""
    backends = {c.backend for c in plan.configs if c.baseline}
    runners: list[Runner] = []
    if TRANSFORMERS in backends:
        runners.append(
            TransformersRunner(plan.resolved.source, num_threads=plan.options.num_threads, eos_token_ids=eos_token_ids)
        )
    return runners + plan.peers.runners(plan.options, eos_token_ids)


def start_baselines(plan: BenchPlan, baselines: list[Runner], steps: Steps) -> tuple[BenchPlan, dict, list[Skipped]]:
    """Start every baseline runner; a peer that cannot run leaves the plan, with the reason.

    Returns the plan without the configurations of the peers that dropped out, the runners' info
    by backend, and what was skipped. A failing transformers baseline is still an error.
    """
    info, skipped, dropped = {}, [], set()
    for runner in baselines:
        try:
            info[runner.backend] = runner.start(steps)
        except PeerUnavailable as exc:
            runner.close()
            dropped.add(runner.backend)
            skipped.append(
                Skipped(what=f"{runner.backend} ({', '.join(c.name for c in runner.configs)})", why=str(exc))
            )
            steps.step(f"skipped {runner.backend}: {exc}")
    if dropped:
        kept = [c for c in plan.configs if c.backend not in dropped]
        steps.total -= round_count(plan) * (len(plan.configs) - len(kept))
        plan = replace(plan, configs=kept)
    return plan, info, skipped


def even_rounds(count: int, parts: int) -> list[range]:
    """Indices ``0..count-1`` in ``parts`` consecutive rounds whose sizes differ by at most one:
    ``even_rounds(80, 2) == [0:40, 40:80]``, ``even_rounds(5, 4) == [0:1, 1:2, 2:3, 3:5]``."""
    edges = [count * i // parts for i in range(parts + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def run_phase(
    plan: BenchPlan,
    runners: dict[str, Runner],
    requests: list[Request],
    collected: dict[str, Collected],
    turn: int,
    steps: Steps,
    batch_requests: list[Request] | None = None,
) -> None:
    """Every configuration on every round of ``requests``, interleaved as finely as each batch size allows.

    At batch 1 a round runs prompt by prompt, every configuration on one prompt before the next prompt
    (the order rotated by one each prompt and round, each baseline beside the configurations it is compared
    with: :func:`~qspec.bench.plan.beside_baselines`): a configuration's runs of a prompt lie seconds
    apart, so the machine's drift hits them alike (docs/perf.md). A
    configuration at batch > 1 runs the round's share of ``batch_requests`` (default: ``requests``) in
    one run, before or after the batch-1 block (alternating by round). A configuration's round wall is
    the sum of its runs in the round."""
    max_new_tokens = plan.options.max_new_tokens
    by_round = rounds(len(requests), plan.options.round_size)
    batch_requests = requests if batch_requests is None else batch_requests
    by_batch_round = even_rounds(len(batch_requests), len(by_round))
    single = beside_baselines([c for c in plan.configs if c.batch == 1])
    blocks: list[RunConfig | None] = [None, *[c for c in plan.configs if c.batch > 1]]  # None: the batch-1 block

    def run(config: RunConfig, batch: list[Request], label: str) -> tuple[float, float]:
        steps.say(f"turn {turn}, {label}: {config.key}")
        meter = CpuMeter()
        result = runners[config.key].run(config, [r[2] for r in batch], max_new_tokens)
        c = collected[config.key]
        for (rid, category, _), request in zip(batch, result.requests):
            c.requests[rid] = (category, request)
        c.calls.update(result.calls)
        c.seconds.update(result.seconds)
        return result.wall_s, meter.other_share()

    for number, indices in enumerate(by_round):
        label = f"round {number + 1}"
        for block in rotated(blocks, number):
            if block is not None:
                wall, other = run(block, [batch_requests[i] for i in by_batch_round[number]], label)
                collected[block.key].walls.append(wall)
                collected[block.key].other_cpu.append(other)
                steps.step(f"turn {turn}, {label}: {block.key} done")
                continue
            walls: dict[str, list[tuple[float, float]]] = {c.key: [] for c in single}
            for j, i in enumerate(indices):
                for config in rotated(single, number + j):
                    walls[config.key].append(run(config, [requests[i]], f"{label}, prompt {j + 1}/{len(indices)}"))
            for config in single:
                runs = walls[config.key]
                collected[config.key].walls.append(sum(w for w, _ in runs))
                collected[config.key].other_cpu.append(sum(w * o for w, o in runs) / max(sum(w for w, _ in runs), 1e-9))
                steps.step(f"turn {turn}, {label}: {config.key} done")


def run_timed(plan: BenchPlan, runners: dict[str, Runner], encode, steps: Steps) -> dict[str, Collected]:
    """Turn 1 on every prompt; with ``turns=2`` the follow-ups, with ``none``'s first answer fed back."""
    collected = {c.key: Collected(c) for c in plan.configs}
    # batch_prompts holds every prompt of prompts (the same file's first N a category, N no smaller)
    first_turns = {
        p.id: (p.id, p.category, encode([{"role": "user", "content": p.turns[0]}])) for p in plan.batch_prompts
    }
    first = [first_turns[p.id] for p in plan.prompts]
    run_phase(plan, runners, first, collected, 1, steps, list(first_turns.values()))
    if plan.options.turns == 2:
        answers = collected[none_config(plan.options.primary_format, plan.options.batch_sizes[0]).key].requests
        second = []
        for p in [p for p in plan.prompts if len(p.turns) >= 2]:
            messages = [
                {"role": "user", "content": p.turns[0]},
                {"role": "assistant", "content": answers[p.id][1].text},
                {"role": "user", "content": p.turns[1]},
            ]
            second.append((f"{p.id}/2", p.category, encode(messages)))
        run_phase(plan, runners, second, collected, 2, steps)
    return collected


class Laps:
    """Seconds per phase of the run, in order."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._mark = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self._mark, 1)
        self._mark = now


@dataclass(frozen=True)
class Measured:
    """What the measuring phases produced, for :func:`build_report`."""

    collected: dict[str, Collected]
    micro: MicroReport | None
    memory: MemoryReport | None
    runner_info: dict[str, RunnerInfo]
    baseline_peaks: dict[str, float | None]  # backend -> peak RSS MB of its process
    skipped: list[Skipped]  # peers that could not start
    first_turns: dict[str, list[int]]  # prompt id -> its first turn's token ids
    head_replays: dict[str, dict[str, HeadReplay]] = field(default_factory=dict)  # config key -> its replay


def _measure(plan: BenchPlan, packages: Packages, steps: Steps, laps: Laps) -> Measured:
    """Load the runners, then micro-benchmark, timed rounds and memory probes."""
    options = plan.options
    qspec = QspecRunner(
        packages.flat,
        [c for c in plan.configs if not c.baseline],
        num_threads=options.num_threads,
        dispatch=options.dispatch,
        draft_package=options.draft_package,
    )
    baselines: list[Runner] = []
    try:
        qspec.start(steps)
        first_turns = [qspec.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in plan.prompts]
        baselines = baseline_runners(plan, qspec.eos_token_ids)
        plan, info, skipped = start_baselines(plan, baselines, steps)
        baselines = [r for r in baselines if r.backend in info]
        laps.lap("load_s")
        wanted = options.analysis and (options.micro_iterations or options.head_methods)
        models = loaded_models(packages.flat, options.num_threads) if wanted else {}
        micro = run_micro(models, options, first_turns, steps) if options.analysis else None
        laps.lap("micro_s")
        runners = {c.key: r for r in [qspec, *baselines] for c in r.configs}
        missing = [c.key for c in plan.configs if c.key not in runners]
        assert not missing, f"configurations without a runner: {missing}"
        collected = run_timed(plan, runners, qspec.encode_chat, steps)
        laps.lap("timed_rounds_s")
        qspec.stop()
        peaks = {r.backend: r.stop() for r in baselines}
        prompts = {p.id: list(tokens) for p, tokens in zip(plan.prompts, first_turns)}
        head_replays = {}
        if options.analysis and options.head_methods:
            steps.say("replaying the draft heads along none's outputs (the speculation ceiling)")
            head_replays = head_replays_of(plan.configs, models, collected, prompts, micro)
            laps.lap("head_replay_s")
    finally:
        for runner in [qspec, *baselines]:
            runner.close()
    memory = None
    if options.memory:
        memory = run_memory(
            plan.configs,
            packages.flat,
            packages.one_spec,
            first_turns,
            max_new_tokens=options.max_new_tokens,
            num_threads=options.num_threads,
            draft_package=options.draft_package,
            steps=steps,
        )
    laps.lap("memory_s")
    runner_info = {backend: i for backend, i in info.items() if i is not None}
    return Measured(collected, micro, memory, runner_info, peaks, skipped, prompts, head_replays)


def _peak_rss(config: RunConfig, measured: Measured) -> float | None:
    if config.baseline:
        return measured.baseline_peaks.get(config.backend)
    probe = measured.memory.probes.get(config.key) if measured.memory else None
    return probe.peak_rss_mb if probe else None


def machine_info(other_cpu: float) -> MachineInfo:
    return MachineInfo(
        cpu=cpu_name(),
        cores=usable_cores(),
        memory_gb=round(psutil.virtual_memory().total / 1e9, 1),
        other_processes_cpu_share=other_cpu,
        **machine_versions(),
    )


def build_report(
    plan: BenchPlan,
    packages: Packages,
    measured: Measured,
    *,
    started: str,
    wall_s: float,
    phases: dict[str, float],
    other_cpu: float,
) -> BenchReport:
    """Summaries, ratios and equality checks of what was measured, as one typed report."""
    collected = measured.collected
    summaries = with_ratios([summarize(c, peak_rss_mb=_peak_rss(c.config, measured)) for c in collected.values()])
    notes = list(plan.resolved.notes) + contention_notes(other_cpu, {s.key: s.round_other_cpu for s in summaries})
    meta = Meta(
        model=plan.model,
        packages=packages.labels(),
        started=started,
        wall_s=wall_s,
        phases=phases,
        options=plan.options,
        prompts=len(plan.prompts),
        batch_prompts=len(plan.batch_prompts),
        categories=sorted({p.category for p in plan.prompts}),
        machine=machine_info(other_cpu),
        runners=measured.runner_info,
        notes=notes,
        skipped=plan.peers.skipped + measured.skipped,
    )
    return BenchReport(
        meta=meta,
        configs=summaries,
        micro=measured.micro,
        memory=measured.memory,
        equality=equality_checks(collected),
        outputs={key: c.tokens() for key, c in collected.items()},
        ceilings=(
            ceilings(collected, measured.first_turns, measured.micro, measured.head_replays)
            if plan.options.analysis
            else []
        ),
    )


def run_bench(
    model: str | os.PathLike[str], options: BenchOptions | None = None, *, progress: Progress | None = None
) -> BenchReport:
    """Run the benchmark of ``model`` (a ``.gguf``, a Hugging Face folder or a compiled package).

    Returns the typed report; :func:`qspec.bench.write_report` writes it out. Raises a QSpecError
    subclass (one line, with the fix) for bad options and failed steps.
    """
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    begin = time.perf_counter()
    meter = CpuMeter()
    plan = make_plan(str(model), options or quick_options())
    steps = Steps(progress, count_units(plan))
    for skipped in plan.peers.skipped:
        steps.say(f"skipping {skipped.what}: {skipped.why}")
    laps = Laps()
    packages = compile_packages(plan.model, plan.resolved, steps)
    laps.lap("compile_s")
    measured = _measure(plan, packages, steps, laps)
    other_cpu = meter.other_share()
    steps.step("report ready")
    return build_report(
        plan,
        packages,
        measured,
        started=started,
        wall_s=round(time.perf_counter() - begin, 1),
        phases=laps.phases,
        other_cpu=other_cpu,
    )
