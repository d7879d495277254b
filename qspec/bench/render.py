"""The report's files: ``report.json`` (the typed report), ``report.md`` (its tables), ``throughput.png``."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from qspec.bench.markdown import fmt, table
from qspec.bench.plan import QSPEC, TRANSFORMERS
from qspec.bench.render_micro import micro_sections
from qspec.bench.report import BenchReport
from qspec.errors import ConfigError


def _calls_per_k(calls: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in calls.items() if k != "prefill" and v)


def _header(report: BenchReport) -> list[str]:
    meta, options, machine = report.meta, report.meta.options, report.meta.machine
    named = {name: version for info in meta.runners.values() for name, version in info.versions.items()}
    named.pop("onnxruntime", None)  # already said, from the engine's process
    versions = "".join(f", {name} {version}" for name, version in named.items())
    phases = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v} s" for k, v in meta.phases.items())
    at_batch = ""
    if meta.batch_prompts and meta.batch_prompts != meta.prompts:
        at_batch = (
            f", at batch > 1 the first turns of {meta.batch_prompts} prompts (a round's share in one "
            "continuous-batching run)"
        )
    lines = [
        "# qspec bench",
        "",
        f"Model `{meta.model}`; {meta.prompts} prompts ({', '.join(meta.categories)}){at_batch}, "
        f"turns {options.turns}, max_new_tokens {options.max_new_tokens}, ctx_len {options.ctx_len}, "
        f"greedy. Started {meta.started}, {meta.wall_s} s in all ({phases}).",
        f"Machine: {machine.cpu}, {machine.cores} cores, {machine.memory_gb} GB; onnxruntime "
        f"{machine.onnxruntime}{versions}.",
        "Rates are over each configuration's summed `generate` wall time; the configurations ran interleaved, "
        "prompt by prompt at batch 1 and round by round at batch > 1, each qspec package and peer model in its own "
        "process. Ratio: requests/s against `none` of the same weight format at the same max batch size. "
        "TTFT at batch > 1 includes the wait for a slot. Other CPU: the share of the machine other processes used "
        "while a configuration ran.",
    ]
    return lines + [f"> Note: {note}" for note in meta.notes]


def _equality(report: BenchReport) -> list[str]:
    equality = report.equality
    verdict = "equal" if equality.speculative_equal_none else "NOT equal"
    lines = ["", "## Greedy outputs", ""]
    lines.append(
        f"Every speculative configuration's greedy output is **{verdict}** to `none`'s at the same batch size "
        "and weight format."
    )
    rows = [
        [
            c.config,
            c.reference,
            c.kind,
            f"{c.equal}/{c.total}",
            f"{c.mean_common_prefix:.3f}",
            ", ".join(f"{m.request}@{m.first_difference_at}" for m in c.mismatches[:5]) or "–",
        ]
        for c in equality.checks
    ]
    header = ["config", "reference", "kind", "equal", "common prefix (mean)", "first mismatches (request@token)"]
    return lines + [""] + table(header, rows)


def _configs(report: BenchReport) -> list[str]:
    rows = []
    for s in report.configs:
        o = s.overall
        rows.append(
            [
                s.key,
                s.weight_format or "–",
                o.requests_per_s,
                o.output_tokens_per_s,
                o.ttft_ms_median,
                o.tpot_ms_median,
                o.mean_accepted_tokens,
                o.acceptance_rate,
                _calls_per_k(o.calls),
                fmt(o.peak_rss_mb, 0),
                fmt(o.ratio_to_none, 3),
                f"{max(s.round_other_cpu or [0]):.0%}",
            ]
        )
    header = [
        "config@batch",
        "weights",
        "req/s",
        "out tok/s",
        "TTFT ms (median)",
        "TPOT ms (median)",
        "tokens/call",
        "acceptance",
        "calls per K",
        "peak RSS MB",
        "x none",
        "other CPU (worst round)",
    ]
    return ["", "## Per configuration", ""] + table(header, rows)


def _acceptance(report: BenchReport) -> list[str]:
    """Mean acceptance length and the acceptance rate per draft position of every configuration that drafted."""
    drafted = [s for s in report.configs if s.overall.reached_per_position and any(s.overall.reached_per_position)]
    if not drafted:
        return []
    depth = max(len(s.overall.reached_per_position) for s in drafted)
    lines = [
        "",
        "## Acceptance per draft position",
        "",
        "Tokens per call: the mean acceptance length, accepted drafts + 1 per target call (every call; per drafted "
        "call: the calls that verified at least one draft). Draft i: of the calls that reached draft i (proposed "
        "at least i drafts, the first i - 1 accepted), the share that accepted it, and (in brackets) how many "
        "calls reached it.",
        "",
    ]
    rows = []
    for s in drafted:
        o = s.overall
        cells = [
            f"{rate:.2f} ({reached})" if rate is not None else f"– ({reached})"
            for rate, reached in zip(o.acceptance_per_position, o.reached_per_position)
        ]
        cells += ["–"] * (depth - len(cells))
        rows.append([s.key, o.mean_accepted_tokens, fmt(o.tokens_per_drafted_call), o.acceptance_rate, *cells])
    header = ["config@batch", "tokens/call", "tokens/drafted call", "acceptance"]
    return lines + table(header + [f"draft {i + 1}" for i in range(depth)], rows)


def _host(report: BenchReport) -> list[str]:
    """Where a decode step of each qspec configuration went: the target's call, drafting, the host's Python."""
    timed = [(s, t) for s in report.configs if (t := s.overall.step) is not None]
    if not timed:
        return []
    rows = [
        [s.key, s.weight_format, t.steps, t.step_ms, t.target_ms, t.drafting_ms, t.host_ms, f"{t.host_share:.1%}"]
        for s, t in timed
    ]
    lines = [
        "",
        "## Host time per decode step",
        "",
        "ms per decode step (wall time outside prefill calls / decode calls): inside the target's call, drafting "
        "(the proposer, a head's calls included) and the host's share (the rest: the engine's dispatch, acceptance, "
        "detokenizing and loop).",
        "",
    ]
    header = ["config@batch", "weights", "decode steps", "step ms", "target call ms", "drafting ms", "host ms"]
    header.append("host share")
    return lines + table(header, rows)


def _categories(report: BenchReport, batch: int) -> list[str]:
    group = [s for s in report.configs if s.batch == batch]
    categories = sorted({c for s in group for c in s.per_category})
    rate = "the throughput" if batch == 1 else "a per-stream rate"
    lines = ["", f"## Per category, batch {batch}", "", f"requests / Σ latency ({rate}), and × none", ""]
    rows = []
    for category in categories:
        row = [category]
        for s in group:
            cell = s.per_category.get(category)
            row.append("–" if cell is None else f"{cell.requests_per_s:.3f} ({fmt(cell.ratio_to_none, 2)}×)")
        rows.append(row)
    return lines + table(["category", *(s.name for s in group)], rows)


def _formats(report: BenchReport) -> list[str]:
    """Each weight format at batch 1: ``none`` and its fastest variable K, against the first format's ``none``."""
    batch1 = [s for s in report.configs if s.backend == QSPEC and s.batch == 1]
    nones = {s.weight_format: s for s in batch1 if s.method == "none"}
    if len(nones) < 2:
        return []
    primary = next(iter(nones.values()))
    agreement = {c.config: c for c in report.equality.checks if c.kind == "format"}
    rows = []
    for weight_format, none in nones.items():
        variable = [s for s in batch1 if s.weight_format == weight_format and len(s.ks) > 1]
        best = max(variable, key=lambda s: s.overall.output_tokens_per_s, default=None)
        check = agreement.get(none.key)
        rows.append(
            [
                weight_format,
                none.overall.output_tokens_per_s,
                fmt(none.overall.output_tokens_per_s / primary.overall.output_tokens_per_s, 3)
                if primary.overall.output_tokens_per_s
                else "–",
                best.name if best else "–",
                best.overall.output_tokens_per_s if best else None,
                fmt(best.overall.ratio_to_none, 3) if best else "–",
                f"{check.equal}/{check.total}" if check else "–",
                fmt(check.mean_common_prefix, 3) if check else "–",
            ]
        )
    header = [
        "weights",
        "none out tok/s",
        f"x {primary.key}",
        "fastest variable K",
        "its out tok/s",
        "its x none",
        f"none equal to {primary.key}",
        "common prefix (mean)",
    ]
    lines = [
        "",
        "## Weight formats (batch 1)",
        "",
        "One package per format; each format's speculative outputs are checked against its own `none` "
        f"(greedy equality holds per package), and each `none` is compared with `{primary.key}` "
        "(agreement, not a gate).",
        "",
    ]
    return lines + table(header, rows)


def _ceilings(report: BenchReport) -> list[str]:
    if not report.ceilings:
        return []
    lines = [
        "",
        "## Speculation ceiling",
        "",
        "Each configuration's proposer replayed along `none`'s greedy output of its weight format and batch size; "
        "an oracle that knows how many drafts each call would accept picks every call's depth, at the "
        "micro-benchmark's prices per compiled K (linear in between). Ceiling: `none`'s decode time over the "
        "oracle's; measured: `none`'s decode ms per token over the configuration's, first turns; captured: "
        "(measured - 1) / (ceiling - 1). The prices are the micro-benchmark's (positions up to 255), not each "
        "call's own, so a dispatch can land a little above its ceiling. At batch B > 1 each row pays a 1/B share "
        "of the batch-B package's calls (every row live) and verifies its own count (ragged rows): a draft pays "
        "only where it is accepted more often than a verified token's share costs against a plain step's.",
    ]
    if any(c.replay == "hidden states" for c in report.ceilings):
        lines.append(
            "Head rows (replay: hidden states): the head proposer is fed the target's hidden states along `none`'s "
            "output, computed by prefill calls over prompt and output, not by the run's verify calls (float sums in "
            "another order: a near-tie of the head's argmax can flip, so the replayed drafts can differ a little "
            "from the run's); the oracle also pays the head's calls at the micro-benchmark's prices (EAGLE one "
            "one-token call per draft, its catch-up priced as one; Medusa one call per drafting step; lookup's "
            "drafts of `+pld` free)."
        )
    lines.append("")
    rows = [
        [
            c.key,
            c.replay,
            c.weight_format,
            c.positions,
            c.drafted_positions,
            c.oracle_calls,
            fmt(c.oracle_x_none, 3),
            fmt(c.measured_x_none, 3),
            fmt(c.captured),
        ]
        for c in report.ceilings
    ]
    header = [
        "config@batch",
        "replay",
        "weights",
        "positions",
        "with drafts",
        "oracle calls",
        "ceiling x none",
        "measured x none",
        "captured",
    ]
    return lines + table(header, rows)


def _memory(report: BenchReport) -> list[str]:
    memory = report.memory
    if not memory:
        return []
    lines = [
        "",
        "## Memory",
        "",
        f"Each configuration in its own process: load, generate {memory.probe_prompts_max_new_tokens} tokens per "
        "prompt (batch-size prompts), RSS after load and peak.",
        "",
    ]
    rows = [
        [key, p.specializations, p.rss_loaded_mb, p.rss_after_generate_mb, p.peak_rss_mb]
        for key, p in memory.probes.items()
    ]
    lines += table(["config", "specializations", "RSS loaded MB", "RSS after generate MB", "peak RSS MB"], rows)
    if memory.ratio:
        lines += [
            "",
            f"Peak RSS with {memory.many_label}: {memory.many_peak_mb:.0f} MB, "
            f"{memory.ratio:.3f} × the K=0 package's {memory.one_peak_mb:.0f} MB "
            f"(`none` on both packages: {fmt(memory.none_ratio, 3)} ×).",
        ]
    return lines


def _peers(report: BenchReport) -> list[str]:
    """The peer runtimes against qspec at batch 1, what they built, and what did not run."""
    peers = [s for s in report.configs if s.backend not in (QSPEC, TRANSFORMERS)]
    lines: list[str] = []
    if peers:
        agreement = {c.config: c for c in report.equality.checks}
        lines += [
            "",
            "## Peers (batch 1)",
            "",
            "Same prompt token ids, token budget and EOS ids as qspec; greedy. Each peer is compared with qspec "
            "`none` of its weight format where qspec ran it (ORT GenAI int4 with `none-int4`), else with "
            "`none`: tokens/s, outputs equal to the reference's, and the mean share of the longer output before "
            "the first difference (exact equality is not expected across runtimes: kernels sum in other orders).",
            "",
        ]
        rows = []
        for s in peers:
            o, check = s.overall, agreement.get(s.key)
            reference = report.config(check.reference if check else "none@1")
            speed = reference.overall.output_tokens_per_s if reference else None
            rows.append(
                [
                    s.key,
                    o.output_tokens_per_s,
                    reference.key if reference else "–",
                    fmt(o.output_tokens_per_s / speed if speed else None, 3),
                    o.ttft_ms_median,
                    o.tpot_ms_median,
                    o.mean_accepted_tokens,
                    o.acceptance_rate,
                    f"{check.equal}/{check.total}" if check else "–",
                    fmt(check.mean_common_prefix, 3) if check else "–",
                ]
            )
        header = [
            "config@batch",
            "out tok/s",
            "qspec reference",
            "tok/s x reference",
            "TTFT ms (median)",
            "TPOT ms (median)",
            "tokens/call",
            "acceptance",
            "equal to reference",
            "common prefix (mean)",
        ]
        lines += table(header, rows)
    builds = [(backend, b) for backend, info in report.meta.runners.items() for b in info.builds]
    if builds:
        lines += ["", "Model files the peers run (a cached one shows the time it took when it was built):", ""]
        lines += table(
            ["backend", "what", "build s", "cached", "MB", "command"],
            [
                [backend, b.what, b.build_s, "yes" if b.cached else "no", fmt(b.size_mb, 0), f"`{b.command}`"]
                for backend, b in builds
            ],
        )
    if report.meta.skipped:
        lines += ["", "## Skipped", ""] + [f"- {s.what}: {s.why}" for s in report.meta.skipped]
    return lines


def render_markdown(report: BenchReport) -> str:
    """``report.md``: the tables of the report."""
    lines = _header(report) + _equality(report) + _configs(report) + _acceptance(report) + _formats(report)
    lines += _ceilings(report) + _peers(report) + _host(report)
    for batch in report.meta.options.batch_sizes:
        lines += _categories(report, batch)
    return "\n".join(lines + micro_sections(report) + _memory(report)) + "\n"


def plot_throughput(report: BenchReport, path: Path) -> None:
    """Requests/s against max batch size, one line per configuration (baselines as points at batch 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for s in report.configs:
        lines[(s.name, s.backend)].append((s.batch, s.overall.requests_per_s))
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for (name, backend), points in lines.items():
        points.sort()
        xs, ys = zip(*points)
        style = "o-" if backend == QSPEC else ("s" if backend == TRANSFORMERS else "^")  # baselines, peers: points
        axes.plot(xs, ys, style, label=name)
    batches = sorted({s.batch for s in report.configs})
    axes.set_xscale("log", base=2)
    axes.set_xticks(batches, [str(b) for b in batches])
    axes.set_xlabel("max batch size")
    axes.set_ylabel("requests/s")
    axes.set_title(f"qspec bench: {Path(report.meta.model).name}")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(report: BenchReport, folder: str | os.PathLike[str]) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` and ``throughput.png`` into ``folder``; returns their paths."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"output {folder} is a file; give a folder")
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "report.json", "markdown": folder / "report.md", "plot": folder / "throughput.png"}
    paths["json"].write_text(report.model_dump_json(indent=2) + "\n")
    paths["markdown"].write_text(render_markdown(report))
    plot_throughput(report, paths["plot"])
    return paths
