"""The ``qspec`` command line: a thin Typer layer that parses options and calls the library."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from qspec_cli.common import (
    DEFAULT_CTX_LEN,
    DEFAULT_PREFILL_SEQ_LEN,
    Backend,
    BatchSizeOption,
    CclDecodeOption,
    CclPrefillOption,
    Command,
    CtxLenOption,
    FullBatchSizeOption,
    KsOption,
    KvCacheBatchSizeOption,
    PrefillSeqLenOption,
    SpecFormatOption,
    WeightFormat,
    cli_errors,
    console,
    escape,
    status,
)

if TYPE_CHECKING:
    pass

app = typer.Typer(
    name="qspec",
    help="Ahead-of-time compiler and runtime for multi-specialization speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is plain: `qspec[serve]` and `run[fp16]/pkg` stay as written
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"qspec {version('qspec')}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.", envvar="QSPEC_DEBUG")] = False,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_version, is_eager=True)
    ] = False,
) -> None:
    """Ahead-of-time compiler and runtime for multi-specialization speculative decoding."""
    if debug:
        os.environ["QSPEC_DEBUG"] = "1"


@app.command(cls=Command)
def compile(
    model: Annotated[
        str, typer.Argument(metavar="MODEL", help="Local Hugging Face model folder or .gguf file (or a hub id online).")
    ],
    num_speculative_tokens: KsOption = "0,4",
    prefill_seq_len: PrefillSeqLenOption = DEFAULT_PREFILL_SEQ_LEN,
    ctx_len: CtxLenOption = DEFAULT_CTX_LEN,
    batch_size: BatchSizeOption = 1,
    full_batch_size: FullBatchSizeOption = None,
    kv_cache_batch_size: KvCacheBatchSizeOption = None,
    comp_ctx_lengths_prefill: CclPrefillOption = None,
    comp_ctx_lengths_decode: CclDecodeOption = None,
    spec_format: SpecFormatOption = "flat",
    backend: Annotated[Backend, typer.Option(help="ort (ONNX Runtime, CPU) or qaic (Qualcomm qaic-compile).")] = "ort",
    num_layers: Annotated[Optional[int], typer.Option(help="Keep only the first N layers (a draft model).")] = None,
    weight_format: Annotated[
        WeightFormat, typer.Option(help="ort: MatMul weights fp32, int8 or int4 (weight-only, MatMulNBits).")
    ] = "fp32",
    hidden_states: Annotated[
        bool, typer.Option(help="The graphs also return the final-norm hidden states (what a draft head reads).")
    ] = False,
    vendor_graph: Annotated[
        bool, typer.Option(help="ort: also ship model.onnx and its fp32 weights (the qaic backend always does).")
    ] = False,
    tree_inputs: Annotated[
        bool,
        typer.Option(
            help="qaic (or --vendor-graph): the vendor graph takes write_slots, tree_mask and kv_moves for K > 0, so "
            "qspec's runtime verifies trees on it (off: the chain-only graph other runtimes run)."
        ),
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
        typer.Option(
            metavar="FLAG", help="qaic: one more -FLAG or -FLAG=VALUE for qaic-compile, verbatim (repeatable)."
        ),
    ] = None,
    mdp_config: Annotated[
        Optional[Path], typer.Option(help="qaic: your partition config (-mdp-load-partition-config), copied in.")
    ] = None,
    draft_head: Annotated[
        Optional[Path],
        typer.Option(
            help="A draft head checkpoint folder (EAGLE-1, EAGLE-3, Medusa or QEfficient turbo) to compile in."
        ),
    ] = None,
    draft_head_weight_format: Annotated[
        Optional[WeightFormat],
        typer.Option(help="ort: the draft head's MatMul weights, fp32, int8 or int4 (default: int8 beside fp32)."),
    ] = None,
    mtp: Annotated[
        bool, typer.Option(help="Compile the MTP layers MODEL's checkpoint ships (DeepSeek nextn, MiMo) as its head.")
    ] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Package directory to write.")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if an identical package exists.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest summary as JSON.")] = False,
) -> None:
    """Export MODEL and compile one prefill + one decode specialization per K into a package."""

    with cli_errors():
        from qspec.backend_records import QaicOptions
        from qspec.backends.qaic_compile import refuse_qaic_options
        from qspec.compile import CompileOptions, compile_package
        from qspec.errors import ConfigError
        from qspec.specializations import make_config

        spec = make_config(
            num_speculative_tokens=num_speculative_tokens,
            prefill_seq_len=prefill_seq_len,
            ctx_len=ctx_len,
            batch_size=batch_size,
            full_batch_size=full_batch_size,
            kv_cache_batch_size=kv_cache_batch_size,
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
        refused = refuse_qaic_options(backend, [qaic_flags[field][0] for field in qaic_given])
        if refused:
            raise ConfigError(refused)
        options = CompileOptions.create(
            specialization=spec,
            spec_format=spec_format,
            backend=backend,
            qaic=QaicOptions.create(**qaic_given),
            num_layers=num_layers,
            weight_format=weight_format,
            hidden_states=hidden_states,
            vendor_graph=vendor_graph,
            tree_inputs=tree_inputs,
            draft_head=str(draft_head) if draft_head else None,
            draft_head_weight_format=draft_head_weight_format,
            mtp=mtp,
        )
        with status("compiling") as say:
            folder, manifest, reused = compile_package(
                model,
                options,
                output=output,
                progress=say,
                warn=lambda m: console.print(f"[yellow]Warning:[/] {escape(m)}"),
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
        scripts = []  # qaic-compile commands written, not run: the target's, then the head's
        if manifest.qaic:
            qaic = manifest.qaic
            if qaic.aic_hw_version is not None:  # None in a package of an older qspec
                print(f"qaic: -aic-hw-version={qaic.aic_hw_version}, KV cache {qaic.kv_precision}")
            for note in qaic.notes:
                print(f"qaic: {note}")
            scripts += [] if qaic.ran else [folder / qaic.script]
        if draft_head or mtp:
            from qspec.head_manifest import HEAD_DIR, read_head_manifest

            head = read_head_manifest(folder)
            print(f"draft head: {head.method} ({head.layout}), {len(head.specializations)} specializations")
            scripts += [folder / HEAD_DIR / head.qaic.script] if head.qaic and not head.qaic.ran else []
        if scripts:
            print(f"qaic-compile not found: run {' then '.join(map(str, scripts))}")


@app.command(cls=Command)
def specializations(
    num_speculative_tokens: KsOption = "0,4",
    prefill_seq_len: PrefillSeqLenOption = DEFAULT_PREFILL_SEQ_LEN,
    ctx_len: CtxLenOption = DEFAULT_CTX_LEN,
    batch_size: BatchSizeOption = 1,
    full_batch_size: FullBatchSizeOption = None,
    kv_cache_batch_size: KvCacheBatchSizeOption = None,
    comp_ctx_lengths_prefill: CclPrefillOption = None,
    comp_ctx_lengths_decode: CclDecodeOption = None,
    spec_format: SpecFormatOption = "flat",
    non_speculative: Annotated[bool, typer.Option(help="A graph without num_logits_to_keep (K=0 only).")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="File to write (default: stdout).")] = None,
) -> None:
    """Write specializations.json for the given shapes (no model needed)."""
    with cli_errors():
        from qspec.spec_file import SpecializationsFile
        from qspec.specializations import make_config

        config = make_config(
            num_speculative_tokens=num_speculative_tokens,
            prefill_seq_len=prefill_seq_len,
            ctx_len=ctx_len,
            batch_size=batch_size,
            full_batch_size=full_batch_size,
            kv_cache_batch_size=kv_cache_batch_size,
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


@app.command(cls=Command)
def info(
    package: Annotated[Path, typer.Argument(metavar="PACKAGE", help="A package directory written by `qspec compile`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print it as JSON.")] = False,
    memory: Annotated[
        bool, typer.Option("--memory", help="Also load it on ONNX Runtime (a child process) and show resident memory.")
    ] = False,
) -> None:
    """Show what PACKAGE holds: the model, the K list, the specializations, the formats, the files."""
    with cli_errors():
        from qspec.package_info import package_info

        found = package_info(package, memory=memory)
        if as_json:
            print(found.model_dump_json(indent=2))
            return
        rows = [
            ("model", f"{found.model} ({found.model_type}, {found.num_layers} layers, vocab {found.vocab_size})"),
            ("backend", found.backend),
            ("weights", found.weight_format),
            ("K", ",".join(map(str, found.num_speculative_tokens))),
            ("ctx_len", found.ctx_len),
            ("prefill_seq_len", found.prefill_seq_len),
            ("KV slots", found.kv_slots),
            ("created", found.created),
            ("size", f"{found.total_bytes / 1e6:.1f} MB on disk in {len(found.files)} files"),
            ("hidden states", "yes (a draft head can read them)" if found.hidden_states else "no"),
            ("draft head", _describe_head(found.head)),
            ("methods", ", ".join(found.methods)),
        ]
        if found.resident is not None:
            held = found.resident
            rows.append(
                (
                    "resident",
                    f"{held.process_bytes / 1e6:.1f} MB after load (the load: {held.load_bytes / 1e6:.1f} MB, "
                    f"KV {held.kv_bytes / 1e6:.1f} MB; {held.load_seconds} s)",
                )
            )
        for label, value in rows:
            print(f"{label:<16} {value}")
        print("specializations")
        for spec in found.specializations:
            print(f"  {spec}")
        print("files")
        for name, size in found.files.items():
            print(f"  {size / 1e6:10.1f} MB  {name}")


def _describe_head(head: dict | None) -> str:
    """``eagle (eagle layout), draft vocabulary 4096 of 49152, int8`` (and its taps), or ``none``."""
    if head is None:
        return "none (compile --draft-head DIR adds one)"
    text = (
        f"{head['kind']} ({head['layout']} layout), draft vocabulary {head['draft_vocab_size']} of "
        f"{head['vocab_size']}, {head['weight_format']}"
    )
    if head["kind"] == "medusa":
        text += f", {head['num_heads']} heads"
    if head.get("taps"):
        text += f", taps {','.join(map(str, head['taps']))}"
    return text


def _register_optional() -> None:
    """Commands that live in their own modules."""
    from qspec_cli.bench import bench
    from qspec_cli.chat import chat
    from qspec_cli.generate import generate
    from qspec_cli.heads import train_head
    from qspec_cli.serve import serve, serve_load

    app.command(cls=Command)(generate)
    app.command(cls=Command)(chat)
    app.command("train-head", cls=Command)(train_head)
    app.command(cls=Command)(serve)
    app.command("serve-load", cls=Command)(serve_load)
    app.command(cls=Command)(bench)


_register_optional()


def _debug_first(args: list[str]) -> list[str]:
    """``--debug`` anywhere before a ``--`` goes first, where the root option reads it (errors say "rerun
    with --debug", and a user adds it at the end): ``generate P --debug`` -> ``--debug generate P``."""
    end = args.index("--") if "--" in args else len(args)
    if "--debug" not in args[:end]:
        return args
    return ["--debug"] + [a for i, a in enumerate(args) if not (a == "--debug" and i < end)]


def main(argv: list[str] | None = None) -> None:
    """Run the command line; a usage error (unknown flag, bad choice, missing argument) is one line and exit 1,
    as every other error (docs/cli.md)."""
    from typer.main import get_command

    try:  # typer >= 0.22 carries its own click
        from typer._click.exceptions import NoArgsIsHelpError, UsageError
    except ImportError:  # pragma: no cover - older typer on click
        from click.exceptions import NoArgsIsHelpError, UsageError

    args = _debug_first(list(sys.argv[1:] if argv is None else argv))
    try:
        code = get_command(app).main(args, prog_name="qspec", standalone_mode=False)
    except NoArgsIsHelpError as exc:
        exc.show()
        code = exc.exit_code
    except UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "qspec"
        message = " ".join(exc.format_message().split())
        console.print(f"[red]Error:[/] {escape(message)} (`{escape(where)} -h` lists the options)")
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
