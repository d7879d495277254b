"""Compile a draft head into a package: ``<package>/head/`` (see :mod:`qspec.head_manifest`).

:func:`compile_head` reads the head checkpoint (any kind of :data:`qspec.heads.kinds.KINDS`), takes the
target's embedding and LM head from the package's own ``model.onnx`` (a head checkpoint rarely carries
them), exports the head graph, writes its runtime graph (:mod:`qspec.heads.ort_graph`), its
specializations, then hands the head's programs to the compile backend
(:meth:`~qspec.backends.base.CompileBackend.prepare_head`: ort runs them once, qaic writes their custom IO and
compile command: a second program beside the target's, as QEfficient compiles a draft model).

Everything that differs between kinds (graph, specializations, custom IO, runtime rewrite, manifest fields)
is the kind's (:class:`~qspec.heads.kind.HeadKind`): EAGLE's specializations are the target's prefill shape,
``seq_len = 1`` (chained drafts) and ``K + 1`` per compiled K (catch-up; a parallel head's also its mask pairs),
Medusa's one per row count.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from qspec.backend_records import QaicOptions
from qspec.backends.registry import compile_backend
from qspec.common import write_text_atomic
from qspec.errors import ConfigError
from qspec.head_manifest import (
    DRAFT_IDS_FILE,
    HEAD_DIR,
    HEAD_MANIFEST,
    HEAD_ONNX,
    HEAD_ORT_ONNX,
    MASK_HIDDEN_FILE,
    HeadManifest,
    HeadWeightFormat,
    program_dir,
)
from qspec.heads.kind import HeadKind
from qspec.spec_file import SpecFormat
from qspec.specializations import SpecializationConfig

Progress = Callable[[str], None]
EMBED_TOKENS = "model.embed_tokens.weight"  # the target graph's initializer names (Hugging Face's)
LM_HEAD = "lm_head.weight"
# Bump when the head's graphs change (they are built from the head's files and this): see head_digest.
# 6: a parallel head's vendor graph hands out its depth's rows; specializations for its mask pairs
HEAD_RECIPE_VERSION = 6


# The target's tables ---------------------------------------------------------------------------------


def target_tables(onnx_path: Path):
    """The target's embedding and LM head from its graph, behind the accessors the head loaders call
    (``get_input_embeddings().weight``, ``get_output_embeddings().weight``, ``[vocab, hidden]``)."""
    import torch

    from qspec.onnx_files import load_model

    initializers = load_model(onnx_path).graph.initializers
    if EMBED_TOKENS not in initializers:
        raise ConfigError(f"{onnx_path} has no {EMBED_TOKENS}; compile the target with this qspec first")
    embed = torch.from_numpy(initializers[EMBED_TOKENS].const_value.numpy().copy())
    lm = embed  # tied
    if LM_HEAD in initializers:
        lm = torch.from_numpy(initializers[LM_HEAD].const_value.numpy().copy())
        if lm.shape == (embed.shape[1], embed.shape[0]):  # the exporter holds MatMul weights [in, out]
            lm = lm.t().contiguous()
    return SimpleNamespace(
        get_input_embeddings=lambda: SimpleNamespace(weight=embed),
        get_output_embeddings=lambda: SimpleNamespace(weight=lm),
    )


def head_digest(head_dir: str | os.PathLike[str]) -> str:
    """Hash of every file of a head folder (names and contents) and of the recipe of its graphs: a package
    whose head was built by an older recipe is rebuilt, not reused."""
    digest = hashlib.sha256(f"head graphs {HEAD_RECIPE_VERSION}".encode())
    folder = Path(head_dir)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:24]


# The runtime graph -----------------------------------------------------------------------------------


def _write_runtime_graph(model, head, kind: HeadKind, folder: Path, config, specs, weight_format: str, say) -> dict:
    """``head.ort.onnx`` (:mod:`qspec.heads.ort_graph`): the kind's rewrite (EAGLE's fusions), in every format;
    a kind without one only when quantized (else the runtime loads ``head.onnx``). Returns the manifest's
    fields that describe it."""
    from qspec.heads import ort_graph

    fields = {"runtime_graph": HEAD_ONNX, "fusions": {}, "quantized_matmuls": 0}
    runtime = ort_graph.copy_model(model)
    say("rewriting the head graph for ONNX Runtime")
    fused = kind.fuse(runtime, head, config, specs)
    if fused is None and weight_format == "fp32":
        return fields
    fields |= fused or {}
    if weight_format != "fp32":
        say(f"quantizing the head's MatMul weights to {weight_format}")
    fields["quantized_matmuls"] = ort_graph.write_runtime_graph(
        runtime, folder / HEAD_ORT_ONNX, weight_format=weight_format
    )
    return fields | {"runtime_graph": HEAD_ORT_ONNX}


def _write_program(head, kind: HeadKind, program: int, folder: Path, config, specs, weight_format, spec_format, say):
    """Program ``program``'s vendor graph, runtime graph and specializations in ``folder``; returns its traced
    head, the runtime graph's manifest fields and how many initializers are stored as float16."""
    from qspec.heads import export

    say(f"exporting the {kind.layout} head graph" + (f" {program}" if kind.programs(head) > 1 else ""))
    folder.mkdir(parents=True, exist_ok=True)
    traced = kind.trace_program(head, config, program)
    runtime = _write_runtime_graph(traced.model, head, kind, folder, config, specs, weight_format, say)
    fp16 = export.store_float16(traced.model)
    export.save(traced.model, folder / HEAD_ONNX)
    kind.write_specializations(specs, folder / "specializations.json", spec_format)
    return traced, runtime, fp16


# Orchestrator ----------------------------------------------------------------------------------------


def compile_head(
    head_dir: str | os.PathLike[str],
    package_dir: str | os.PathLike[str],
    *,
    config: SpecializationConfig,
    target_fingerprint: str,
    weight_format: HeadWeightFormat = "fp32",
    backend: str = "ort",
    spec_format: SpecFormat = "flat",
    qaic: QaicOptions | None = None,
    target_onnx: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> HeadManifest:
    """Put the head of ``head_dir`` into ``package_dir/head/`` and return its manifest.

    ``config``: the target's specialization config (Ks, prefill, ctx_len, batch sizes).
    ``target_onnx``: the target graph holding its tables (default: the package's ``model.onnx``).
    """
    from qspec.heads import export
    from qspec.heads.kinds import load_head
    from qspec.package import ONNX_FILE

    say = progress or (lambda message: None)
    begin = time.perf_counter()
    package = Path(package_dir)
    folder = package / HEAD_DIR
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tables = target_tables(Path(target_onnx) if target_onnx else package / ONNX_FILE)
    say(f"reading the draft head {head_dir}")
    head, kind = load_head(head_dir, tables)
    vocab, hidden = tables.get_input_embeddings().weight.shape
    if kind.hidden_size(head) != hidden:
        width = kind.hidden_size(head)
        raise ConfigError(f"the draft head's hidden size {width} differs from the target's {hidden}; use a head for it")
    kind.prepare(head)

    specs = kind.specializations(head, config)
    programs = kind.programs(head)
    built = [
        _write_program(head, kind, i, folder / program_dir(i), config, specs, weight_format, spec_format, say)
        for i in range(programs)
    ]
    traced, runtime, fp16 = built[0]  # every program is built alike

    draft_ids_file = None
    if head.draft_ids is not None:
        draft_ids_file = DRAFT_IDS_FILE
        np.save(folder / DRAFT_IDS_FILE, head.draft_ids.numpy().astype(np.int64))
    parallel = getattr(head, "parallel", None)
    if parallel is not None:
        np.save(folder / MASK_HIDDEN_FILE, head.mask_hidden.detach().float().numpy())
    manifest = HeadManifest(
        method=kind.method,
        layout=kind.layout,
        source=str(head_dir),
        digest=head_digest(head_dir),
        target_fingerprint=target_fingerprint,
        hidden_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=head.draft_vocab_size,
        draft_ids_file=draft_ids_file,
        parallel_depth=parallel.depth if parallel else None,
        mask_token_id=parallel.mask_token_id if parallel else None,
        mask_hidden_file=MASK_HIDDEN_FILE if parallel else None,
        **kind.manifest_fields(head, config),
        full_batch_size=config.full_batch_size,
        continuous_batching=config.continuous_batching,
        **runtime,
        weight_format=weight_format,
        float16_initializers=fp16,
        input_names=traced.input_names,
        output_names=traced.output_names,
        specializations=specs,
        spec_format=spec_format,
        backend=backend,
        programs=programs,
        graph_bytes=sum(export.graph_bytes(folder / program_dir(i) / HEAD_ONNX) for i in range(programs)),
        runtime_graph_bytes=sum(
            export.graph_bytes(folder / program_dir(i) / runtime["runtime_graph"]) for i in range(programs)
        ),
        export_seconds=round(time.perf_counter() - begin, 2),
    )
    folders = [folder / program_dir(i) for i in range(programs)]
    manifest = compile_backend(backend).prepare_head(folders, kind, manifest, qaic or QaicOptions(), progress=say)
    write_text_atomic(folder / HEAD_MANIFEST, manifest.model_dump_json(indent=2) + "\n")
    return manifest


def fold_head_taps(head_dir: str | os.PathLike[str], target_onnx: Path, graphs: list[Path], num_layers: int) -> None:
    """Fold the head's ``fc`` into the target graphs ``graphs``, exported with the head's taps
    (:func:`qspec.export.taps.fold_taps`; ``target_onnx``: the vendor graph holding the target's tables); a head
    that reads no taps leaves them as they are."""
    from qspec.export.taps import fold_taps
    from qspec.heads.kinds import load_head

    head, kind = load_head(head_dir, target_tables(target_onnx))
    taps = kind.taps(head, num_layers)
    if taps is None:
        return
    for path in graphs:
        fold_taps(path, taps.layer_ids, taps.fc.numpy())
