"""``qspec bench``: a thin Typer layer over :func:`qspec.bench.run_bench` with a progress bar on stderr."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from qspec_cli.common import (
    DEFAULT_CTX_LEN,
    DEFAULT_PREFILL_SEQ_LEN,
    CclDecodeOption,
    CclPrefillOption,
    CtxLenOption,
    DispatchOption,
    DraftPackageOption,
    PrefillSeqLenOption,
    cli_errors,
    console,
    escape,
)

if TYPE_CHECKING:
    from qspec.bench import BenchOptions, BenchReport


def bench(
    model: Annotated[
        str, typer.Argument(metavar="MODEL", help="A .gguf file, a Hugging Face model folder, or a compiled package.")
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Folder for report.json, report.md, throughput.png.")
    ] = Path("bench-out"),
    full: Annotated[
        bool,
        typer.Option(
            "--full", help="All 80 MT-bench prompts, batch sizes 1,2,4,8 (quick: 2 per category at batch 1, 80 at 4)."
        ),
    ] = False,
    prompts: Annotated[Optional[Path], typer.Option(help="JSONL of prompts (default: MT-bench).")] = None,
    per_category: Annotated[Optional[int], typer.Option(help="First N prompts of each category; 0 = all.")] = None,
    batch_per_category: Annotated[
        Optional[int],
        typer.Option(
            help="At batch > 1: first N prompts of each category (quick default 10: all of MT-bench); 0 = all."
        ),
    ] = None,
    turns: Annotated[
        Optional[int], typer.Option(help="1, or 2: MT-bench follow-ups with the first answer fed back.")
    ] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Tokens per request (default 128).")] = None,
    batch_sizes: Annotated[Optional[str], typer.Option(help="Max batch sizes, e.g. 1,4.")] = None,
    methods: Annotated[
        Optional[str],
        typer.Option(help="Speculative methods besides none: pld,suffix,draft, eagle,medusa,eagle+pld,medusa+pld."),
    ] = None,
    k_lists: Annotated[Optional[str], typer.Option(help="K lists separated by ';', e.g. '4;0,4;0,1,2,4,8'.")] = None,
    draft_package: DraftPackageOption = None,
    draft_head: Annotated[
        Optional[Path],
        typer.Option(
            help="A draft head checkpoint (EAGLE-1, EAGLE-3, Medusa, turbo) compiled into the bench's packages; "
            "its method and its +pld combination join the methods."
        ),
    ] = None,
    baselines: Annotated[bool, typer.Option(help="Run the transformers baselines (batch 1).")] = True,
    peers: Annotated[
        bool,
        typer.Option(
            help="Run ONNX Runtime GenAI and llama.cpp (batch 1) where installed: pip install 'qspec[peers]'."
        ),
    ] = True,
    memory: Annotated[bool, typer.Option(help="Measure peak RSS per configuration, one process each.")] = True,
    analysis: Annotated[
        bool,
        typer.Option(
            "--analysis",
            help="Also analyse: micro-benchmarks, head replays, speculation ceilings (what bench/targets.py reads).",
        ),
    ] = False,
    micro_iterations: Annotated[
        Optional[int], typer.Option(help="With --analysis: calls per specialization in the micro-benchmark; 0 = skip.")
    ] = None,
    prefill_chunk_sizes: Annotated[
        Optional[str],
        typer.Option(
            help="Prefill chunk sizes whose TTFT the micro phase times, e.g. 32,64,128 "
            "(default 16,32,64,128,256 up to what the packages take; '' = none)."
        ),
    ] = None,
    round_size: Annotated[
        Optional[int],
        typer.Option(
            help="Prompts per round (batch 1 interleaves prompt by prompt; batch > 1 runs a round's share at once)."
        ),
    ] = None,
    ctx_len: CtxLenOption = DEFAULT_CTX_LEN,
    prefill_seq_len: PrefillSeqLenOption = DEFAULT_PREFILL_SEQ_LEN,
    comp_ctx_lengths_prefill: CclPrefillOption = None,
    comp_ctx_lengths_decode: CclDecodeOption = None,
    num_threads: Annotated[
        Optional[int], typer.Option(help="Threads for ONNX Runtime and torch (default: all cores).")
    ] = None,
    packages_dir: Annotated[Optional[Path], typer.Option(help="Where compiled packages are cached.")] = None,
    dispatch: DispatchOption = "auto",
    weight_formats: Annotated[
        Optional[str],
        typer.Option(
            help="Weight formats of qspec's packages, e.g. fp32,int4 (quick default; --full: fp32,int8,int4). "
            "fp32 always runs; the others run none and variable K at batch 1."
        ),
    ] = None,
    tree_widths: Annotated[
        Optional[str],
        typer.Option(
            help="Head methods at batch 1 at each width, e.g. 1,2 (2: the head's runner-up beside the chain, a tree; "
            "default 1)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole report as JSON on stdout.")] = False,
) -> None:
    """Benchmark none / fixed K / variable K (and transformers, ORT GenAI, llama.cpp) on a prompt set; report."""

    with cli_errors():
        from qspec.bench import bench_options, run_bench, write_report

        options = bench_options(
            full=full,
            prompts=prompts,
            per_category=per_category,
            batch_per_category=batch_per_category,
            turns=turns,
            max_new_tokens=max_new_tokens,
            batch_sizes=batch_sizes,
            methods=methods,
            k_lists=k_lists,
            draft_package=draft_package,
            draft_head=draft_head,
            baselines=baselines,
            peers=peers,
            memory=memory,
            analysis=analysis,
            micro_iterations=micro_iterations,
            prefill_chunk_sizes=prefill_chunk_sizes,
            round_size=round_size,
            ctx_len=ctx_len,
            prefill_seq_len=prefill_seq_len,
            num_threads=num_threads,
            packages_dir=packages_dir,
            comp_ctx_lengths_prefill=comp_ctx_lengths_prefill,
            comp_ctx_lengths_decode=comp_ctx_lengths_decode,
            dispatch=dispatch,
            weight_formats=weight_formats,
            tree_widths=tree_widths,
        )
        report = _run_with_progress(model, options, run_bench)
        paths = write_report(report, output)
        for skipped in report.meta.skipped:  # on stderr, with --json too
            console.print(f"[yellow]Skipped:[/] {escape(skipped.what)}: {escape(skipped.why)}")
        if as_json:
            print(report.model_dump_json(indent=2))
            return
        _print_summary(report, paths)


def _run_with_progress(model: str, options: BenchOptions, run_bench) -> BenchReport:
    """A progress bar on a terminal; elsewhere (make, CI logs) one line per step."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not console.is_terminal:
        start = time.perf_counter()

        def log(message: str, done: int, total: int) -> None:
            console.print(
                f"[dim]{time.perf_counter() - start:7.1f}s[/] {escape(f'[{done}/{total}]')} {escape(message)}"
            )

        return run_bench(model, options, progress=log)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("starting", total=None)

        def progress(message: str, done: int, total: int) -> None:
            bar.update(task, description=escape(message), completed=done, total=total)

        return run_bench(model, options, progress=progress)


def _print_summary(report: BenchReport, paths: dict[str, Path]) -> None:
    verdict = "equal" if report.equality.speculative_equal_none else "NOT equal"
    print(f"speculative greedy outputs {verdict} to none's")
    for s in report.configs:
        o = s.overall
        versus = f"  {o.ratio_to_none:.2f}x none" if o.ratio_to_none else ""
        print(f"  {s.key:<24} {o.requests_per_s:8.3f} req/s {o.output_tokens_per_s:8.1f} tok/s{versus}")
    for note in report.meta.notes:
        console.print(f"[yellow]Note:[/] {escape(note)}")

    print(f"wrote {paths['markdown']}, {paths['json']}, {paths['plot']} ({report.meta.wall_s} s)")
