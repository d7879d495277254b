"""The ``qspec`` command line: a thin Typer layer that parses options and calls the library."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from qspec_cli.common import (
    DEFAULT_CTX_LEN,
    DEFAULT_PREFILL_SEQ_LEN,
    BatchSizeOption,
    CclDecodeOption,
    CclPrefillOption,
    CtxLenOption,
    DispatchOption,
    DraftPackageOption,
    FullBatchSizeOption,
    KsOption,
    PrefillSeqLenOption,
    SpecFormatOption,
    console,
    run_guarded,
    status,
)

app = typer.Typer(
    name="qspec",
    help="Ahead-of-time compiler and runtime for multi-specialization speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.", envvar="QSPEC_DEBUG")] = False,
) -> None:
    """Ahead-of-time compiler and runtime for multi-specialization speculative decoding."""
    if debug:
        os.environ["QSPEC_DEBUG"] = "1"


@app.command()
def compile(
    model: Annotated[str, typer.Argument(help="Local Hugging Face model folder or .gguf file (or a hub id online).")],
    num_speculative_tokens: KsOption = "0,4",
    prefill_seq_len: PrefillSeqLenOption = DEFAULT_PREFILL_SEQ_LEN,
    ctx_len: CtxLenOption = DEFAULT_CTX_LEN,
    batch_size: BatchSizeOption = 1,
    full_batch_size: FullBatchSizeOption = None,
    comp_ctx_lengths_prefill: CclPrefillOption = None,
    comp_ctx_lengths_decode: CclDecodeOption = None,
    spec_format: SpecFormatOption = "flat",
    backend: Annotated[str, typer.Option(help="ort (ONNX Runtime, CPU) or qaic (Qualcomm qaic-compile).")] = "ort",
    num_layers: Annotated[Optional[int], typer.Option(help="Keep only the first N layers (a draft model).")] = None,
    weight_format: Annotated[
        str, typer.Option(help="ort: MatMul weights fp32, int8 or int4 (weight-only, MatMulNBits).")
    ] = "fp32",
    hidden_states: Annotated[
        bool, typer.Option(help="The graphs also return the final-norm hidden states (what a draft head reads).")
    ] = False,
    aic_hw_version: Annotated[
        Optional[str], typer.Option(help="qaic: -aic-hw-version, ai100 or ai200 (default: from qaic-util, else ai100).")
    ] = None,
    num_cores: Annotated[Optional[int], typer.Option(help="qaic: -aic-num-cores (default 16).")] = None,
    num_devices: Annotated[Optional[int], typer.Option(help="qaic: devices (>1 writes a partition config).")] = None,
    mxfp6_matmul: Annotated[bool, typer.Option(help="qaic: -mxfp6-matmul (MXFP6 weights).")] = False,
    mxint8_kv_cache: Annotated[bool, typer.Option(help="qaic: KV cache in mxint8 (custom IO list).")] = False,
    mos: Annotated[Optional[int], typer.Option(help="qaic: -mos.")] = None,
    aic_enable_depth_first: Annotated[bool, typer.Option(help="qaic: -aic-enable-depth-first.")] = False,
    qaic_option: Annotated[
        Optional[list[str]],
        typer.Option(help="qaic: one more -FLAG or -FLAG=VALUE for qaic-compile, verbatim (repeatable)."),
    ] = None,
    mdp_config: Annotated[
        Optional[Path], typer.Option(help="qaic: your partition config (-mdp-load-partition-config), copied in.")
    ] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Package directory to write.")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if an identical package exists.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest summary as JSON.")] = False,
) -> None:
    """Export MODEL and compile one prefill + one decode specialization per K into a package."""

    def work() -> None:
        from qspec.backends.qaic import QaicOptions
        from qspec.compile import CompileOptions, compile_package
        from qspec.errors import ConfigError
        from qspec.specializations import make_config

        spec = make_config(
            num_speculative_tokens=num_speculative_tokens,
            prefill_seq_len=prefill_seq_len,
            ctx_len=ctx_len,
            batch_size=batch_size,
            full_batch_size=full_batch_size,
            comp_ctx_lengths_prefill=comp_ctx_lengths_prefill,
            comp_ctx_lengths_decode=comp_ctx_lengths_decode,
        )
        qaic_flags = {  # QaicOptions field: (flag, value if given)
            "aic_hw_version": ("--aic-hw-version", aic_hw_version),
            "num_cores": ("--num-cores", num_cores),
            "num_devices": ("--num-devices", num_devices),
            "mxfp6_matmul": ("--mxfp6-matmul", mxfp6_matmul or None),
            "mxint8_kv_cache": ("--mxint8-kv-cache", mxint8_kv_cache or None),
            "mos": ("--mos", mos),
            "aic_enable_depth_first": ("--aic-enable-depth-first", aic_enable_depth_first or None),
            "compiler_options": ("--qaic-option", qaic_option or None),
            "mdp_config": ("--mdp-config", str(mdp_config.resolve()) if mdp_config else None),
        }
        qaic_given = {field: value for field, (_, value) in qaic_flags.items() if value is not None}
        if backend != "qaic" and qaic_given:
            flags = ", ".join(qaic_flags[field][0] for field in qaic_given)
            raise ConfigError(f"{flags}: qaic-only; add --backend qaic, or drop them for the {backend} backend")
        options = CompileOptions.create(
            specialization=spec,
            spec_format=spec_format,
            backend=backend,
            qaic=QaicOptions.create(**qaic_given),
            num_layers=num_layers,
            weight_format=weight_format,
            hidden_states=hidden_states,
        )
        with status("compiling") as say:
            folder, manifest, reused = compile_package(
                model,
                options,
                output=output,
                progress=say,
                warn=lambda m: console.print(f"[yellow]Warning:[/] {m}"),
                force=force,
            )
        from qspec.package import manifest_summary

        summary = manifest_summary(manifest) | {"package": str(folder), "reused": reused}
        if as_json:
            print(json.dumps(summary, indent=2))
            return
        verb = "reused" if reused else "wrote"
        print(
            f"{verb} {folder} ({manifest.backend}, {manifest.weight_format}, {len(manifest.specializations)} "
            f"specializations, {manifest.compile_seconds} s)"
        )
        for spec in manifest.specializations:
            print(f"  {spec.describe()}")
        if manifest.qaic:
            qaic = manifest.qaic
            if qaic.aic_hw_version is not None:  # None in a package of an older qspec
                print(f"qaic: -aic-hw-version={qaic.aic_hw_version}, KV cache {qaic.kv_precision}")
            for note in qaic.notes:
                print(f"qaic: {note}")
            if not qaic.ran:
                print(f"qaic-compile not found: the command is in {folder / qaic.script}")

    run_guarded(work)


@app.command()
def specializations(
    num_speculative_tokens: KsOption = "0,4",
    prefill_seq_len: PrefillSeqLenOption = DEFAULT_PREFILL_SEQ_LEN,
    ctx_len: CtxLenOption = DEFAULT_CTX_LEN,
    batch_size: BatchSizeOption = 1,
    full_batch_size: FullBatchSizeOption = None,
    comp_ctx_lengths_prefill: CclPrefillOption = None,
    comp_ctx_lengths_decode: CclDecodeOption = None,
    spec_format: SpecFormatOption = "flat",
    non_speculative: Annotated[bool, typer.Option(help="A graph without num_logits_to_keep (K=0 only).")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="File to write (default: stdout).")] = None,
) -> None:
    """Write specializations.json for the given shapes (no model needed)."""

    def work() -> None:
        from qspec.spec_file import SpecializationsFile
        from qspec.specializations import make_config

        config = make_config(
            num_speculative_tokens=num_speculative_tokens,
            prefill_seq_len=prefill_seq_len,
            ctx_len=ctx_len,
            batch_size=batch_size,
            full_batch_size=full_batch_size,
            comp_ctx_lengths_prefill=comp_ctx_lengths_prefill,
            comp_ctx_lengths_decode=comp_ctx_lengths_decode,
            speculative=not non_speculative,
        )
        request = SpecializationsFile.create(config=config, spec_format=spec_format)
        if output is None:
            sys.stdout.write(request.to_json())
        else:
            count = len(request.write(output))
            print(f"wrote {output} ({count} specializations)")

    run_guarded(work)


@app.command()
def generate(
    package: Annotated[Path, typer.Argument(help="A package directory written by `qspec compile`.")],
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="One prompt.")] = None,
    prompts_file: Annotated[
        Optional[Path], typer.Option(help='JSONL file: one {"prompt": ...} (or "turns": [...]) per line.')
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate per prompt.")] = 128,
    method: Annotated[str, typer.Option(help="none, pld, suffix or draft.")] = "pld",
    prompt_lookup_min: Annotated[int, typer.Option(help="pld: smallest n-gram to match.")] = 1,
    prompt_lookup_max: Annotated[int, typer.Option(help="pld: largest n-gram to match.")] = 3,
    draft_package: DraftPackageOption = None,
    max_batch_size: Annotated[Optional[int], typer.Option(help="Sequences in flight (default: all KV slots).")] = None,
    dispatch: DispatchOption = "auto",
    backend: Annotated[
        str, typer.Option(help="ort (ONNX Runtime, CPU) or qaic (the package's QPC on Cloud AI 100).")
    ] = "ort",
    chat: Annotated[bool, typer.Option(help="Apply the tokenizer's chat template.")] = False,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(help="1 = off.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print token ids, text and metrics per request as JSON.")
    ] = False,
) -> None:
    """Generate text from a compiled package with speculative decoding."""

    def work() -> None:
        from qspec.errors import ConfigError
        from qspec.prompts import read_prompt_texts
        from qspec.runtime import Engine, SamplingParams

        if (prompt is None) == (prompts_file is None):
            raise ConfigError("give exactly one of --prompt TEXT or --prompts-file FILE.jsonl")
        prompts = [prompt] if prompt is not None else read_prompt_texts(prompts_file)
        params = SamplingParams.create(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop or []
        )
        # Each method takes the knobs it knows (qspec.runtime.proposers.make_proposer).
        knobs = dict(
            prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max, draft_package=draft_package
        )
        with status("loading the package"):
            engine = Engine(
                package, method=method, max_batch_size=max_batch_size, dispatch=dispatch, backend=backend, **knobs
            )
        stream = not as_json and len(prompts) == 1
        on_text = (lambda i, text: (sys.stdout.write(text), sys.stdout.flush())) if stream else None
        outputs = engine.generate(prompts, params, chat=chat, on_text=on_text)
        metrics = engine.last_metrics
        if as_json:
            print(json.dumps({"requests": [o.to_dict() for o in outputs], "metrics": metrics.to_dict()}, indent=2))
            return
        if stream:
            sys.stdout.write("\n")
        else:
            for out in outputs:
                print(f"--- {out.index}\n{out.text}")
        console.print(
            f"[dim]{metrics.output_tokens} tokens in {metrics.wall_s:.2f} s: {metrics.output_tokens_per_s:.1f} tok/s, "
            f"TTFT {metrics.ttft_ms_median:.0f} ms, TPOT {metrics.tpot_ms_median:.1f} ms, "
            f"{metrics.mean_accepted_tokens:.2f} tokens/call, acceptance {metrics.acceptance_rate:.0%}, "
            f"calls per K {metrics.calls}[/]"
        )

    run_guarded(work)


def _register_optional() -> None:
    """Commands that live in their own modules."""
    from qspec_cli.heads import train_head
    from qspec_cli.serve import serve, serve_load

    app.command("train-head")(train_head)
    app.command()(serve)
    app.command("serve-load")(serve_load)
    try:
        from qspec_cli.bench import bench
    except ImportError:  # pragma: no cover - bench is part of the package; guard for partial installs
        return
    app.command()(bench)


_register_optional()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
