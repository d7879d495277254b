"""``qspec compile``: export (cached), build the specializations, prepare a backend, write a package.

The package is built in a temporary sibling directory and moved into place only when complete; a
package whose manifest records the same inputs (model digest, options, qspec version) is reused.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from qspec import __version__, contract
from qspec.backends.qaic import QaicOptions, QaicResult, prepare_qaic
from qspec.common import FrozenModel
from qspec.errors import CompileError, QSpecError
from qspec.onnx_files import link_or_copy
from qspec.package import (
    MANIFEST,
    ONNX_FILE,
    ORT_ONNX_FILE,
    SPECIALIZATIONS_FILE,
    TOKENIZER_DIR,
    Backend,
    Manifest,
    ModelEntry,
    RuntimeGraph,
    SessionCheck,
    WeightFormat,
    attention_slack,
    dump_manifest,
    read_manifest,
    runtime_graph_file,
    write_package_atomic,
)
from qspec.spec_file import SpecFormat, write_specializations
from qspec.specializations import (
    Specialization,
    SpecializationConfig,
    build_specializations,
    ccl_notes,
    check_model_speculative_config,
)

if TYPE_CHECKING:
    from qspec.export.exporter import ExportMeta

Progress = Callable[[str], None]


class CompileOptions(FrozenModel):
    """Everything ``qspec compile`` takes besides the model and the output folder."""

    specialization: SpecializationConfig
    spec_format: SpecFormat = "flat"
    backend: Backend = "ort"
    qaic: QaicOptions = Field(default_factory=QaicOptions)
    num_layers: int | None = Field(default=None, ge=1)  # keep the first N layers (a draft model)
    weight_format: WeightFormat = "fp32"  # MatMul weights of the runtime graph (backend ort)
    hidden_states: bool = False  # the graphs also return the final-norm hidden states (draft heads read them)
    draft_head: str | None = None  # a draft head checkpoint folder (any kind of qspec.heads.kinds): PACKAGE/head/
    draft_head_weight_format: WeightFormat | None = None  # the head's runtime-graph MatMuls; None: head_weight_format
    vendor_graph: bool = False  # backend ort: also ship model.onnx and its fp32 weights (backend qaic always does)
    mtp: bool = False  # the model checkpoint's own MTP layers as the head (qspec.heads.mtp)

    @property
    def ships_vendor_graph(self) -> bool:
        """The package holds ``model.onnx`` and its fp32 weights: what the qaic backend compiles, or asked for. An
        ort package is the runtime graph alone (its weights in the weight format), not a second copy of the model."""
        return self.backend == "qaic" or self.vendor_graph

    @property
    def head_weight_format(self) -> WeightFormat:
        """The draft head's MatMul weights in its runtime graph: as asked, else int8 beside an fp32 target on the ort
        backend (a head call reads its weights from memory after every target call; docs/heads.md compares the
        formats), else the target's format. Drafts never change greedy output, whatever their weights."""
        if self.draft_head_weight_format is not None:
            return self.draft_head_weight_format
        return "int8" if self.weight_format == "fp32" and self.backend == "ort" else self.weight_format

    @property
    def exports_hidden_states(self) -> bool:
        """A draft head reads the target's hidden states: its package's graphs return them."""
        return self.hidden_states or self.draft_head is not None or self.mtp

    @property
    def has_head(self) -> bool:
        return self.draft_head is not None or self.mtp

    @model_validator(mode="after")
    def _vendor_compresses_its_own_weights(self) -> CompileOptions:
        if self.backend == "qaic" and self.weight_format != "fp32":
            raise ValueError(
                f"weight_format {self.weight_format} is for the ort backend; the qaic backend compiles the "
                "fp32 graph and compresses weights itself: use --mxfp6-matmul"
            )
        if self.backend == "qaic" and self.draft_head_weight_format not in (None, "fp32"):
            raise ValueError(
                f"draft_head_weight_format {self.draft_head_weight_format} is for the ort backend; the qaic backend "
                "compiles the head's fp32 graph and compresses weights itself"
            )
        return self

    @model_validator(mode="after")
    def _head_format_needs_a_head(self) -> CompileOptions:
        if self.draft_head_weight_format is not None and not self.has_head:
            raise ValueError("draft_head_weight_format is the head's: give --draft-head too (or --mtp), or drop it")
        if self.mtp and self.draft_head is not None:
            raise ValueError("a package holds one head: give --mtp or --draft-head, not both")
        return self

    @model_validator(mode="after")
    def _qaic_options_need_qaic(self) -> CompileOptions:
        given = qaic_options_given(self.qaic)
        if self.backend != "qaic" and given:
            raise ValueError(
                f"{', '.join(given)} {'is a qaic option' if len(given) == 1 else 'are qaic options'}: "
                f"add --backend qaic, or drop {'it' if len(given) == 1 else 'them'} for the {self.backend} backend"
            )
        return self


def qaic_options_given(options: QaicOptions) -> list[str]:
    """The qaic options that differ from their defaults, as ``num_cores=8``."""
    defaults = QaicOptions()
    return [
        f"{name}={getattr(options, name)!r}"
        for name in type(options).model_fields
        if getattr(options, name) != getattr(defaults, name)
    ]


def qaic_ccl_rule(options: CompileOptions) -> SpecializationConfig:
    """The specialization config to build: on the qaic backend the CCL lists follow qaic-compile's rules
    (:mod:`qspec.ccl`, rule ``qefficient``), which the manifest then records for the runtime."""
    config = options.specialization
    if options.backend != "qaic" or config.ccl_rule == "qefficient":
        return config
    return SpecializationConfig.create(**(config.model_dump() | {"ccl_rule": "qefficient"}))


def default_output(model: str | os.PathLike[str], options: CompileOptions) -> Path:
    """``packages/<model name>-k<Ks>[-fbs<F>][-kv<N>]`` under the working directory."""
    name = Path(str(model).rstrip("/")).name.removesuffix(".gguf")
    ks = "_".join(str(k) for k in options.specialization.num_speculative_tokens)
    fbs, kv = options.specialization.full_batch_size, options.specialization.kv_cache_batch_size
    suffix = (f"-fbs{fbs}" if fbs else "") + (f"-kv{kv}" if kv else "")
    layers = f"-l{options.num_layers}" if options.num_layers else ""
    weights = f"-{options.weight_format}" if options.weight_format != "fp32" else ""
    return Path("packages") / f"{name}{layers}{weights}-k{ks}{suffix}"


def _inputs_key(digest: str, options: CompileOptions) -> str:
    """Everything a package is built from: the model, the options, and the versions of what builds its graphs
    (a package of an older exporter or runtime-graph recipe is rebuilt, not reused)."""
    from qspec.backends.ort_optimize import RECIPE_VERSION
    from qspec.export.exporter import EXPORT_FORMAT

    # The vendor options shape only a qaic package: an ort package is reused whatever they say. A draft
    # head counts by its content (below), not its path.
    exclude = {"draft_head", "draft_head_weight_format"} | ({"qaic"} if options.backend != "qaic" else set())
    payload = json.dumps(
        {
            "digest": digest,
            "options": options.model_dump(mode="json", exclude=exclude),
            "qspec": __version__,
            "export_format": EXPORT_FORMAT,
            "runtime_graph_recipe": RECIPE_VERSION,
            "mdp_config": _file_digest(options.qaic.mdp_config) if options.backend == "qaic" else None,
        }
        | (
            {"draft_head": _head_digest(options.draft_head), "head_weight_format": options.head_weight_format}
            if options.draft_head
            else {"head_weight_format": options.head_weight_format}
            if options.mtp
            else {}
        )
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _file_digest(path: str | None) -> str | None:
    """The user's partition file by content: an edited file rebuilds the package (a missing one fails later)."""
    if path is None or not Path(path).is_file():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _head_taps(head_dir: str | None) -> tuple[int, ...] | str:
    """The taps of the target's residual stream the draft head reads (EAGLE-3), ``()`` for none."""
    if head_dir is None:
        return ()
    from qspec.heads.kinds import detect_kind, head_config

    return detect_kind(head_dir).tap_request(Path(head_dir), head_config(head_dir))


def _fold_taps(folder: Path, exported: _Exported, graph: _Graph | None, options: CompileOptions) -> None:
    """The head's ``fc`` folded into the package's graphs: their ``tap.{i}`` outputs become ``hidden_states``."""
    if not exported.meta.options.taps:
        return
    from qspec.heads.package import fold_head_taps

    graphs = [folder / ONNX_FILE] if options.ships_vendor_graph else []
    graphs += [folder / graph.graph.file] if graph is not None else []
    fold_head_taps(options.draft_head, exported.folder / ONNX_FILE, graphs, exported.entry.num_layers)


def _head_digest(head_dir: str | None) -> str | None:
    if head_dir is None:
        return None
    from qspec.heads.package import head_digest

    return head_digest(head_dir)


@dataclass(frozen=True)
class _Exported:
    """What the export phase hands on: the export folder and its record, the package's model entry, the
    specializations to build and the warnings about them."""

    folder: Path
    meta: ExportMeta
    entry: ModelEntry
    specs: list[Specialization]
    warnings: list[str]
    gguf: Path | None  # the GGUF file the model came from: its blocks may be carried into an int8/int4 graph


@dataclass(frozen=True)
class _Graph:
    """The runtime graph (backend ort): the cache folder holding its files, and how it was made."""

    folder: Path
    graph: RuntimeGraph


def _reusable(target: Path, key: str) -> Manifest | None:
    """The package at ``target`` when it was built from the same inputs and its runtime graph is there."""
    if not (target / MANIFEST).is_file():
        return None
    try:
        existing = read_manifest(target)
    except QSpecError:
        return None
    if existing.inputs_key == key and (target / runtime_graph_file(existing)).is_file():
        return existing
    return None


def _export(
    model: str | os.PathLike[str],
    options: CompileOptions,
    config: SpecializationConfig,
    *,
    digest: str,
    progress: Progress,
) -> _Exported:
    """Export the model (cached) in the graph variant ``config`` needs; build the specializations."""
    from qspec.export import ExportOptions, export_model
    from qspec.export.loader import resolve_source

    taps = _head_taps(options.draft_head)
    export_options = ExportOptions(
        continuous_batching=config.continuous_batching,
        speculative=config.speculative,
        comp_ctx_lengths=config.comp_ctx_lengths,
        num_layers=options.num_layers,
        hidden_states=options.exports_hidden_states and not taps,  # taps: the head's fc makes them (_fold_taps)
        taps=taps,
    )
    if options.backend == "ort":  # while the export runs in its own process: the next step's imports (~3 s)
        threading.Thread(target=_import_runtime_graph_tools, daemon=True).start()
    folder, meta = export_model(model, export_options, progress=progress, digest=digest)
    warnings = check_model_speculative_config(meta.model.speculative_config, config.num_speculative_tokens)
    specs = build_specializations(config)
    warnings += ccl_notes(config, specs)
    entry = ModelEntry(
        **meta.model.model_dump(),
        source=meta.source,
        digest=meta.digest,
        export_key=meta.key,
        continuous_batching=export_options.continuous_batching,
        speculative=export_options.speculative,
        comp_ctx_lengths=export_options.comp_ctx_lengths,
        truncated_layers=options.num_layers,
        hidden_states=options.exports_hidden_states,
    )
    source = resolve_source(model)
    gguf = source.folder / source.gguf_file if source.gguf_file else None
    return _Exported(folder, meta, entry, specs, warnings, gguf)


def _runtime_graph(
    exported: _Exported, options: CompileOptions, config: SpecializationConfig, *, progress: Progress
) -> _Graph:
    """The graph the embedded runtime loads (cached): fused, in the options' weight format, RoPE rows for
    ``ctx_len`` and the longest call."""
    from qspec.backends.ort_optimize import cached_runtime_graph

    folder, graph = cached_runtime_graph(
        exported.folder,
        exported.meta.key,
        options.weight_format,
        progress=progress,
        attention=exported.meta.model.attention,
        positions=config.ctx_len + attention_slack(max(spec.seq_len for spec in exported.specs)),
        # no drafts, no verify call whose rounding a one-token call must match
        lone_query=config.num_speculative_tokens == (0,),
        gguf=exported.gguf,
    )
    return _Graph(folder, graph)


def _write_files(folder: Path, exported: _Exported, graph: _Graph | None, options: CompileOptions) -> None:
    """The vendor graph (when shipped), the runtime graph, the tokenizer and the specializations file.

    An fp32 runtime graph reads most of its weights from the vendor graph's data file (stored once), so that file
    is in every fp32 package; ``model.onnx`` itself only where the vendor graph ships."""
    vendor_files = sorted(exported.folder.glob(ONNX_FILE + "*")) if options.ships_vendor_graph else []
    if graph is not None and not vendor_files:  # the data file it reads: beside its own, or its only one (unfused)
        reads = {graph.graph.vendor_data_file, graph.graph.data_file} & {ONNX_FILE + ".data"}
        vendor_files = [exported.folder / name for name in sorted(reads)]
    for path in vendor_files:
        link_or_copy(path, folder / path.name)
    if graph is not None:
        for path in sorted(graph.folder.glob(ORT_ONNX_FILE + "*")):
            link_or_copy(path, folder / path.name)
    shutil.copytree(exported.folder / TOKENIZER_DIR, folder / TOKENIZER_DIR)
    write_specializations(exported.specs, folder / SPECIALIZATIONS_FILE, fmt=options.spec_format)


def _prepare_vendor(folder: Path, entry: ModelEntry, options: CompileOptions, *, progress: Progress) -> QaicResult:
    """Backend qaic: custom_io.yaml and the qaic-compile command (run when the compiler is installed)."""
    progress("preparing the qaic-compile command")
    return prepare_qaic(
        folder,
        onnx_path=folder / ONNX_FILE,
        specializations_path=folder / SPECIALIZATIONS_FILE,
        num_layers=entry.num_layers,
        options=options.qaic,
        feature_outputs=(contract.HIDDEN_STATES,) if options.exports_hidden_states else (),
    )


def _check_or_prepare_vendor(
    folder: Path, exported: _Exported, graph: _Graph | None, options: CompileOptions, *, progress: Progress
) -> tuple[list[SessionCheck], QaicResult | None]:
    """Backend ort: run every specialization of the runtime graph once (:func:`check_ort`); backend qaic:
    the vendor files (:func:`_prepare_vendor`)."""
    if graph is not None:
        return check_ort(folder / graph.graph.file, exported.specs, exported.entry.vocab_size, progress=progress), None
    return [], _prepare_vendor(folder, exported.entry, options, progress=progress)


def _add_draft_head(
    folder: Path,
    model: str | os.PathLike[str],
    options: CompileOptions,
    config: SpecializationConfig,
    exported: _Exported,
    *,
    progress: Progress,
) -> None:
    """The draft head's own graphs and manifest in ``PACKAGE/head/`` (:mod:`qspec.heads.package`); the target's
    embedding and LM head are read from the export's vendor graph (an ort package does not ship it). With ``mtp``
    the model folder is the head's checkpoint (its MTP layers, :mod:`qspec.heads.mtp`)."""
    from qspec.heads.package import compile_head

    compile_head(
        model if options.mtp else options.draft_head,
        folder,
        config=config,
        target_fingerprint=exported.meta.key,
        target_onnx=exported.folder / ONNX_FILE,
        weight_format=options.head_weight_format,
        backend=options.backend,
        spec_format=options.spec_format,
        qaic=options.qaic,
        progress=progress,
    )


def _manifest(
    key: str,
    exported: _Exported,
    options: CompileOptions,
    config: SpecializationConfig,
    graph: _Graph | None,
    checks: list[SessionCheck],
    qaic: QaicResult | None,
    *,
    start: float,
) -> Manifest:
    """The package's manifest: its inputs key, what was built from what, the checks, the versions."""
    meta = exported.meta
    return Manifest(
        inputs_key=key,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=exported.entry,
        config=config,
        specializations=exported.specs,
        spec_format=options.spec_format,
        backend=options.backend,
        vendor_graph=options.ships_vendor_graph,
        runtime_graph=graph.graph if graph is not None else None,
        ort_checks=checks,
        qaic=qaic,
        versions={**meta.versions, "onnxruntime": _ort_version(), "export_seconds": str(meta.export_seconds)},
        compile_seconds=round(time.perf_counter() - start, 2),
        warnings=exported.warnings,
    )


def _import_runtime_graph_tools() -> None:
    import onnx_ir  # noqa: F401
    import onnxscript.rewriter.ort_fusions  # noqa: F401

    import qspec.backends.ort_optimize  # noqa: F401


def check_ort(onnx_path: Path, specs, vocab_size: int, *, progress: Progress) -> list[SessionCheck]:
    """Load and run one static-shape session per specialization, one at a time.

    A specialization that does not load or run, or whose logits have another shape or are not finite, raises
    a one-line CompileError that names it.
    """
    from qspec.backends import ort as ort_backend

    checks = []
    for spec in specs:
        progress(f"checking a static session for {spec.describe()}")
        begin = time.perf_counter()
        session = ort_backend.create_session(onnx_path, spec, prepack=False)
        loaded = time.perf_counter() - begin
        ort_backend.check_static(session, spec)
        begin = time.perf_counter()
        try:
            ort_backend.smoke_run(session, spec, vocab_size)
        except CompileError:
            raise
        except Exception as exc:  # ORT raises plain RuntimeErrors / Fail, several lines long
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CompileError(f"ONNX Runtime could not run specialization {spec.describe()}: {first}") from exc
        ran = time.perf_counter() - begin
        checks.append(SessionCheck(specialization=spec, load_seconds=round(loaded, 2), run_ms=round(ran * 1000, 1)))
        del session
    return checks


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def compile_package(
    model: str | os.PathLike[str],
    options: CompileOptions,
    *,
    output: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
    force: bool = False,
) -> tuple[Path, Manifest, bool]:
    """Compile ``model`` into a package; returns (package dir, manifest, reused).

    Raises a QSpecError subclass (one line, with the fix) for bad options, unsupported models and
    backend failures; nothing is left at ``output`` unless the package is complete.
    """
    from qspec.export.loader import check_family, resolve_source, source_digest

    say = progress or (lambda message: None)
    warn = warn or (lambda message: None)
    start = time.perf_counter()
    target = Path(output) if output is not None else default_output(model, options)
    config = qaic_ccl_rule(options)  # a bad bucket list fails before any work

    source = resolve_source(model)
    check_family(source)
    if options.mtp:
        from qspec.heads.mtp import find_mtp

        find_mtp(model)  # a checkpoint without MTP layers fails before any work
    say("hashing model files")
    digest = source_digest(source)
    key = _inputs_key(digest, options)
    existing = None if force else _reusable(target, key)
    if existing is not None:
        return target, existing, True

    exported = _export(model, options, config, digest=digest, progress=say)
    for message in exported.warnings:
        warn(message)
    graph = _runtime_graph(exported, options, config, progress=say) if options.backend == "ort" else None

    def build(folder: Path) -> None:
        say("writing the package")
        _write_files(folder, exported, graph, options)
        _fold_taps(folder, exported, graph, options)
        checks, qaic = _check_or_prepare_vendor(folder, exported, graph, options, progress=say)
        if options.has_head:
            _add_draft_head(folder, model, options, config, exported, progress=say)
        dump_manifest(_manifest(key, exported, options, config, graph, checks, qaic, start=start), folder)

    write_package_atomic(target, build)
    return target, read_manifest(target), False
