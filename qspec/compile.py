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
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from qspec import __version__
from qspec.backend_records import QaicOptions
from qspec.backends.base import BuiltGraph, Exported
from qspec.backends.qaic_compile import qaic_options_given, refuse_qaic_options
from qspec.backends.registry import BACKENDS, compile_backend
from qspec.common import FrozenModel
from qspec.errors import QSpecError
from qspec.onnx_files import link_or_copy
from qspec.package import (
    MANIFEST,
    ONNX_FILE,
    ORT_ONNX_FILE,
    SPECIALIZATIONS_FILE,
    TOKENIZER_DIR,
    Manifest,
    ModelEntry,
    WeightFormat,
    dump_manifest,
    read_manifest,
    runtime_graph_file,
    write_package_atomic,
)
from qspec.spec_file import SpecFormat, write_specializations
from qspec.specializations import (
    SpecializationConfig,
    build_specializations,
    ccl_notes,
    check_model_speculative_config,
)

Progress = Callable[[str], None]


class CompileOptions(FrozenModel):
    """Everything ``qspec compile`` takes besides the model and the output folder."""

    specialization: SpecializationConfig
    spec_format: SpecFormat = "flat"
    backend: str = "ort"  # a name of qspec.backends.registry.BACKENDS
    qaic: QaicOptions = Field(default_factory=QaicOptions)
    num_layers: int | None = Field(default=None, ge=1)  # keep the first N layers (a draft model)
    weight_format: WeightFormat = "fp32"  # MatMul weights of the runtime graph (backend ort)
    hidden_states: bool = False  # the graphs also return the final-norm hidden states (draft heads read them)
    draft_head: str | None = None  # a draft head checkpoint folder (any kind of qspec.heads.kinds): PACKAGE/head/
    draft_head_weight_format: WeightFormat | None = None  # the head's runtime-graph MatMuls; None: head_weight_format
    vendor_graph: bool = False  # backend ort: also ship model.onnx and its fp32 weights (backend qaic always does)
    # The vendor graph verifies trees: write_slots, tree_mask and kv_moves inputs for K > 0 (a runtime that feeds
    # them: qspec's). Off, the vendor graph is the chain-only one QEfficient-style runtimes run. The ort runtime graph
    # verifies trees either way.
    tree_inputs: bool = False
    mtp: bool = False  # the model checkpoint's own MTP layers as the head (qspec.heads.mtp)

    @property
    def ships_vendor_graph(self) -> bool:
        """The package holds ``model.onnx`` and its fp32 weights: what a vendor backend compiles, or asked for. An
        ort package is the runtime graph alone (its weights in the weight format), not a second copy of the model."""
        return compile_backend(self.backend).ships_vendor_graph or self.vendor_graph

    @property
    def head_weight_format(self) -> WeightFormat:
        """The draft head's MatMul weights in its runtime graph: as asked, else the backend's choice
        (:meth:`~qspec.backends.base.CompileBackend.head_weight_format`: int8 beside an fp32 target on ort)."""
        if self.draft_head_weight_format is not None:
            return self.draft_head_weight_format
        return compile_backend(self.backend).head_weight_format(self.weight_format)

    @property
    def exports_hidden_states(self) -> bool:
        """A draft head reads the target's hidden states: its package's graphs return them."""
        return self.hidden_states or self.draft_head is not None or self.mtp

    @property
    def has_head(self) -> bool:
        return self.draft_head is not None or self.mtp

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in BACKENDS:
            raise ValueError(f"unknown backend {value!r}: use one of {', '.join(BACKENDS)}")
        return value

    @model_validator(mode="after")
    def _fits_the_backend(self) -> CompileOptions:
        compile_backend(self.backend).validate(self)
        return self

    @model_validator(mode="after")
    def _head_format_needs_a_head(self) -> CompileOptions:
        if self.draft_head_weight_format is not None and not self.has_head:
            raise ValueError("draft_head_weight_format is the head's: give --draft-head too (or --mtp), or drop it")
        if self.mtp and self.draft_head is not None:
            raise ValueError("a package holds one head: give --mtp or --draft-head, not both")
        return self

    @model_validator(mode="after")
    def _tree_inputs_need_a_vendor_graph_with_drafts(self) -> CompileOptions:
        if self.tree_inputs and not self.ships_vendor_graph:
            raise ValueError(
                "tree_inputs are the vendor graph's (--backend qaic or --vendor-graph); the ort runtime graph "
                "verifies trees without them: drop --tree-inputs"
            )
        if self.tree_inputs and max(self.specialization.num_speculative_tokens) == 0:
            raise ValueError("tree_inputs need a decode shape with drafts: add a K > 0 (-k 0,4) or drop --tree-inputs")
        return self

    @model_validator(mode="after")
    def _qaic_options_need_qaic(self) -> CompileOptions:
        refused = refuse_qaic_options(self.backend, qaic_options_given(self.qaic))
        if refused:
            raise ValueError(refused)
        return self


def backend_ccl_rule(options: CompileOptions) -> SpecializationConfig:
    """The specialization config to build: the CCL lists follow the backend's compiler's rules where it has some
    (:mod:`qspec.ccl`; qaic: rule ``qefficient``), which the manifest then records for the runtime."""
    config = options.specialization
    rule = compile_backend(options.backend).ccl_rule
    if rule is None or config.ccl_rule == rule:
        return config
    return SpecializationConfig.create(**(config.model_dump() | {"ccl_rule": rule}))


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

    # Options the backend never reads (the vendor's, for ort) leave the package reused whatever they say. A draft
    # head counts by its content (below), not its path.
    backend = compile_backend(options.backend)
    exclude = {"draft_head", "draft_head_weight_format"} | set(backend.unread_options)
    payload = json.dumps(
        {
            "digest": digest,
            "options": options.model_dump(mode="json", exclude=exclude),
            "qspec": __version__,
            "export_format": EXPORT_FORMAT,
            "runtime_graph_recipe": RECIPE_VERSION,
            "mdp_config": backend.input_files_digest(options),
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


def _head_taps(head_dir: str | None) -> tuple[int, ...] | str:
    """The taps of the target's residual stream the draft head reads (EAGLE-3), ``()`` for none."""
    if head_dir is None:
        return ()
    from qspec.heads.kinds import detect_kind, head_config

    return detect_kind(head_dir).tap_request(Path(head_dir), head_config(head_dir))


def _fold_taps(folder: Path, exported: Exported, graph: BuiltGraph | None, options: CompileOptions) -> None:
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


def tree_inputs(options: CompileOptions, config: SpecializationConfig) -> bool:
    """The vendor graph takes the tree inputs (``write_slots``, ``tree_mask``, ``kv_moves``): when asked
    (``--tree-inputs``) and a decode shape has drafts (``K > 0``); without them the package is a chain-only one."""
    return options.tree_inputs and max(config.num_speculative_tokens) > 0


def _export(
    model: str | os.PathLike[str],
    options: CompileOptions,
    config: SpecializationConfig,
    *,
    digest: str,
    progress: Progress,
) -> Exported:
    """Export the model (cached) in the graph variant ``config`` needs; build the specializations."""
    from qspec.export import ExportOptions, export_model
    from qspec.export.loader import resolve_source

    taps = _head_taps(options.draft_head)
    export_options = ExportOptions(
        continuous_batching=config.continuous_batching,
        speculative=config.speculative,
        comp_ctx_lengths=config.comp_ctx_lengths,
        tree_inputs=tree_inputs(options, config),
        num_layers=options.num_layers,
        hidden_states=options.exports_hidden_states and not taps,  # taps: the head's fc makes them (_fold_taps)
        taps=taps,
    )
    compile_backend(options.backend).before_export()
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
        tree_inputs=export_options.tree_inputs,
        truncated_layers=options.num_layers,
        hidden_states=options.exports_hidden_states,
    )
    source = resolve_source(model)
    gguf = source.folder / source.gguf_file if source.gguf_file else None
    return Exported(folder, meta, entry, specs, warnings, gguf)


def _write_files(folder: Path, exported: Exported, graph: BuiltGraph | None, options: CompileOptions) -> None:
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


def _add_draft_head(
    folder: Path,
    model: str | os.PathLike[str],
    options: CompileOptions,
    config: SpecializationConfig,
    exported: Exported,
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
    exported: Exported,
    options: CompileOptions,
    config: SpecializationConfig,
    graph: BuiltGraph | None,
    backend_fields: dict,
    *,
    start: float,
) -> Manifest:
    """The package's manifest: its inputs key, what was built from what, the backend's record (its checks, its
    compile command), the versions."""
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
        **backend_fields,
        versions={**meta.versions, "onnxruntime": _ort_version(), "export_seconds": str(meta.export_seconds)},
        compile_seconds=round(time.perf_counter() - start, 2),
        warnings=exported.warnings,
    )


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
    config = backend_ccl_rule(options)  # a bad bucket list fails before any work
    backend = compile_backend(options.backend)

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
    graph = backend.build_graph(exported, options, config, progress=say)

    def build(folder: Path) -> None:
        say("writing the package")
        _write_files(folder, exported, graph, options)
        _fold_taps(folder, exported, graph, options)
        fields = backend.prepare(folder, exported, graph, options, progress=say)
        if options.has_head:
            _add_draft_head(folder, model, options, config, exported, progress=say)
        dump_manifest(_manifest(key, exported, options, config, graph, fields, start=start), folder)

    write_package_atomic(target, build)
    return target, read_manifest(target), False
