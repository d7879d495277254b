"""Compile a draft head into a package: ``<package>/head/`` (see :mod:`qspec.heads.manifest`).

:func:`compile_head` reads the head checkpoint (any layout of :mod:`qspec.heads.modules`), takes the
target's embedding and LM head from the package's own ``model.onnx`` (a head checkpoint rarely carries
them), exports the head graph, writes its runtime graph (:mod:`qspec.heads.ort_graph`), its
specializations and, for ``qaic``, its own custom IO and compile command: a second program beside the
target's, as QEfficient compiles a draft model.

Specializations (one shape per step and per covering K, like the target's):

- EAGLE: the target's prefill shape (prompt features), then ``seq_len = 1`` (chained drafts) and
  ``seq_len = K + 1`` for every compiled K (catch-up over the accepted tokens), sorted, de-duplicated.
  Example, ``K = 0, 1, 4``, prefill 32, ctx 128, batch 1: seq_len 32, 1, 2, 5.
- Medusa: ``batch_size`` of prefill and of decode (one row per sequence, ``seq_len = 1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from qspec import contract
from qspec.backends.qaic import (
    CUSTOM_IO_FILE,
    DEFAULT_COMPILER,
    QPC_DIR,
    SCRIPT_FILE,
    QaicOptions,
    QaicResult,
    compile_script,
    custom_io_yaml,
    find_compiler,
    qaic_compile_argv,
    run_compiler,
    write_executable,
)
from qspec.common import write_text_atomic
from qspec.errors import CompileError, ConfigError
from qspec.heads.manifest import (
    DRAFT_IDS_FILE,
    HEAD_DIR,
    HEAD_MANIFEST,
    HEAD_ONNX,
    HEAD_ORT_ONNX,
    HeadManifest,
    HeadWeightFormat,
)
from qspec.spec_file import SpecFormat, write_specializations
from qspec.specializations import Specialization, SpecializationConfig

Progress = Callable[[str], None]
EMBED_TOKENS = "model.embed_tokens.weight"  # the target graph's initializer names (Hugging Face's)
LM_HEAD = "lm_head.weight"
# Bump when the head's graphs change (they are built from the head's files and this): see head_digest.
HEAD_RECIPE_VERSION = 4


# Specializations -------------------------------------------------------------------------------------


def _dedupe(specs: list[Specialization]) -> list[Specialization]:
    kept: list[Specialization] = []
    for spec in specs:
        if spec not in kept:
            kept.append(spec)
    return kept


def eagle_specializations(config: SpecializationConfig) -> list[Specialization]:
    """The target's prefill shape, then ``seq_len`` 1 and ``K + 1`` per compiled K, ascending (no logits
    count: the head returns the last real token of each row)."""
    rows, fbs = config.full_batch_size or config.batch_size, config.full_batch_size
    prefill = Specialization(
        batch_size=config.batch_size, seq_len=config.prefill_seq_len, ctx_len=config.ctx_len, full_batch_size=fbs
    )
    steps = sorted({1, *(k + 1 for k in config.num_speculative_tokens)})
    decode = [Specialization(batch_size=rows, seq_len=s, ctx_len=config.ctx_len, full_batch_size=fbs) for s in steps]
    return _dedupe([prefill, *decode])


def medusa_specializations(config: SpecializationConfig) -> list[Specialization]:
    """One shape per row count: the prefill's and the decode's (``seq_len`` 1, no KV)."""
    rows = config.full_batch_size or config.batch_size
    return _dedupe([Specialization(batch_size=b, seq_len=1, ctx_len=config.ctx_len) for b in (config.batch_size, rows)])


def write_head_specializations(
    specs: list[Specialization], path: Path, *, method: str, fmt: SpecFormat = "flat"
) -> None:
    """The project's writer; a Medusa graph has only ``batch_size``, so its file names only that symbol."""
    if method == "eagle":
        write_specializations(specs, path, fmt=fmt)
        return
    symbols = [{contract.BATCH_SIZE: str(spec.batch_size)} for spec in specs]
    entries = (
        [{"name": f"Batch_{s[contract.BATCH_SIZE]}", "symbols": s} for s in symbols] if fmt == "named" else symbols
    )
    write_text_atomic(path, json.dumps({"specializations": entries}, indent=2) + "\n")


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


# Vendor files ----------------------------------------------------------------------------------------


def head_custom_io(method: str, *, kv_dtype: str) -> str:
    """The head's custom IO: its KV (EAGLE) and the features it reads and writes, in ``kv_dtype`` (the
    target's ``hidden_states`` output has the same precision, so the runtime hands it over unconverted)."""
    names = [contract.HIDDEN_STATES] + ([contract.HIDDEN_STATES_OUT] if method == "eagle" else [])
    features = "".join(f" - IOName: {name}\n   Precision: {kv_dtype}\n\n" for name in names)
    return (custom_io_yaml(1, kv_dtype=kv_dtype) if method == "eagle" else "") + features


def prepare_head_qaic(head_dir: Path, method: str, options: QaicOptions, *, run: bool | None = None) -> QaicResult:
    """Write ``custom_io.yaml`` and ``compile_qaic.sh`` for the head graph (paths relative to ``head_dir``);
    compile when a compiler is found (``run=None``), always (``True``) or never (``False``)."""
    write_text_atomic(head_dir / CUSTOM_IO_FILE, head_custom_io(method, kv_dtype=options.io_float_dtype))
    compiler = None if run is False else find_compiler()
    if run and compiler is None:
        raise ConfigError("no QAIC compiler found: set QAIC_COMPILE or put qaic-compile on PATH")
    argv = qaic_compile_argv(
        compiler=compiler or DEFAULT_COMPILER,
        onnx_path=HEAD_ONNX,
        specializations_path="specializations.json",
        custom_io_path=CUSTOM_IO_FILE,
        qpc_dir=QPC_DIR,
        options=options,
    )
    write_executable(head_dir / SCRIPT_FILE, compile_script(argv))
    if compiler is not None:
        run_compiler(argv, cwd=head_dir)
    return QaicResult(
        compiler=compiler,
        ran=compiler is not None,
        argv=argv,
        script=SCRIPT_FILE,
        qpc_dir=QPC_DIR,
        custom_io=CUSTOM_IO_FILE,
        mdp_partition_config=None,
        onnx=HEAD_ONNX,
        specializations="specializations.json",
        options=options,
    )


# The runtime graph -----------------------------------------------------------------------------------


def _write_runtime_graph(model, head, method: str, folder: Path, config, specs, weight_format: str, say) -> dict:
    """``head.ort.onnx`` (:mod:`qspec.heads.ort_graph`): EAGLE's fused, in every format; Medusa's only when
    quantized (else the runtime loads ``head.onnx``). Returns the manifest's fields that describe it."""
    from qspec.heads import export, ort_graph
    from qspec.package import attention_slack

    fields = {"runtime_graph": HEAD_ONNX, "fusions": {}, "quantized_matmuls": 0}
    if method != "eagle" and weight_format == "fp32":
        return fields
    runtime = ort_graph.copy_model(model)
    if method == "eagle":
        say("fusing the head's attention (GroupQueryAttention) and RMSNorm")
        kv_slack = attention_slack(max(spec.seq_len for spec in specs))
        rope_positions = config.ctx_len + kv_slack
        fusions = ort_graph.fuse_eagle(runtime, export.eagle_attention_info(head), rope_positions=rope_positions)
        fields |= {"fusions": fusions, "kv_slack": kv_slack, "rope_positions": rope_positions}
    if weight_format != "fp32":
        say(f"quantizing the head's MatMul weights to {weight_format}")
    fields["quantized_matmuls"] = ort_graph.write_runtime_graph(
        runtime, folder / HEAD_ORT_ONNX, weight_format=weight_format
    )
    return fields | {"runtime_graph": HEAD_ORT_ONNX}


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
    from qspec.heads.modules import load_head
    from qspec.package import ONNX_FILE

    say = progress or (lambda message: None)
    begin = time.perf_counter()
    package = Path(package_dir)
    folder = package / HEAD_DIR
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tables = target_tables(Path(target_onnx) if target_onnx else package / ONNX_FILE)
    say(f"reading the draft head {head_dir}")
    head, layout = load_head(head_dir, tables)
    method = "eagle" if layout == "eagle" else "medusa"
    vocab, hidden = tables.get_input_embeddings().weight.shape
    _check_fits(head, method, hidden)
    if method == "medusa":
        head.share_equal_lm_heads()  # one table in the graph, not one per head

    say(f"exporting the {method} head graph")
    if method == "eagle":
        model = export.trace_eagle(head, continuous_batching=config.continuous_batching)
        names = export.eagle_input_names(continuous_batching=config.continuous_batching), export.eagle_output_names()
        specs = eagle_specializations(config)
    else:
        model = export.trace_medusa(head)
        names = [contract.HIDDEN_STATES], [contract.LOGITS]
        specs = medusa_specializations(config)
    runtime = _write_runtime_graph(model, head, method, folder, config, specs, weight_format, say)
    fp16 = export.store_float16(model)
    export.save(model, folder / HEAD_ONNX)

    draft_ids_file = None
    if head.draft_ids is not None:
        draft_ids_file = DRAFT_IDS_FILE
        np.save(folder / DRAFT_IDS_FILE, head.draft_ids.numpy().astype(np.int64))
    write_head_specializations(specs, folder / "specializations.json", method=method, fmt=spec_format)
    qaic_result = None
    if backend == "qaic":
        say("preparing the head's qaic-compile command")
        qaic_result = prepare_head_qaic(folder, method, qaic or QaicOptions())
    eagle = method == "eagle"
    manifest = HeadManifest(
        method=method,
        layout=layout,
        source=str(head_dir),
        digest=head_digest(head_dir),
        target_fingerprint=target_fingerprint,
        hidden_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=head.draft_vocab_size,
        draft_ids_file=draft_ids_file,
        num_heads=1 if eagle else head.num_heads,
        num_layers=1 if eagle else head.num_layers,
        num_kv_heads=head.config.num_key_value_heads if eagle else None,
        head_dim=head.layers[0].self_attn.head_dim if eagle else None,
        ctx_len=config.ctx_len if eagle else None,
        full_batch_size=config.full_batch_size,
        continuous_batching=config.continuous_batching,
        **runtime,
        weight_format=weight_format,
        float16_initializers=fp16,
        input_names=names[0],
        output_names=names[1],
        specializations=specs,
        spec_format=spec_format,
        backend=backend,
        qaic=qaic_result,
        graph_bytes=export.graph_bytes(folder / HEAD_ONNX),
        runtime_graph_bytes=export.graph_bytes(folder / runtime["runtime_graph"]),
        export_seconds=round(time.perf_counter() - begin, 2),
    )
    if backend == "ort":
        say("checking the head graph in ONNX Runtime")
        check_head_sessions(folder, manifest)
    write_text_atomic(folder / HEAD_MANIFEST, manifest.model_dump_json(indent=2) + "\n")
    return manifest


def example_feeds(manifest: HeadManifest, spec: Specialization) -> dict[str, np.ndarray]:
    """Inputs of one call of ``spec``'s shape: token 0, positions from 0, zero features and KV."""
    batch, seq = spec.batch_size, spec.seq_len
    features = np.zeros((batch, seq, manifest.hidden_size), np.float32)
    if manifest.method == "medusa":
        return {contract.HIDDEN_STATES: features}
    feeds = {
        contract.INPUT_IDS: np.zeros((batch, seq), np.int64),
        contract.POSITION_IDS: np.tile(np.arange(seq, dtype=np.int64), (batch, 1)),
        contract.HIDDEN_STATES: features,
    }
    if manifest.continuous_batching:
        feeds[contract.BATCH_INDEX] = np.arange(batch, dtype=np.int64)[:, None]
    rows = spec.full_batch_size or batch
    for name in contract.kv_names(1):
        feeds[name] = np.zeros((rows, *manifest.kv_shape), np.float32)
    return feeds


def check_head_sessions(folder: Path, manifest: HeadManifest) -> None:
    """Run the head's runtime graph once per specialization; the logits must have the shape the manifest says."""
    import onnxruntime as ort

    from qspec.backends import ort_plan

    session = ort.InferenceSession(str(folder / manifest.runtime_graph), providers=["CPUExecutionProvider"])
    names = {value.name for value in session.get_inputs()}
    for spec in manifest.specializations:
        feeds = example_feeds(manifest, spec)
        if contract.POSITION_IDS in feeds:  # a one-slot EAGLE head takes the host's call plan
            feeds |= ort_plan.feeds(feeds[contract.POSITION_IDS], 1, names)
        try:
            logits = session.run([contract.LOGITS], feeds)[0]
        except Exception as exc:  # ORT raises plain RuntimeErrors
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CompileError(f"the draft head graph fails for {spec.describe()}: {first}") from exc
        rows = manifest.num_heads if manifest.method == "medusa" else 1
        want = (spec.batch_size, rows, manifest.draft_vocab_size)
        if logits.shape != want:
            raise CompileError(f"the draft head returns logits {logits.shape} for {spec.describe()}, expected {want}")


def _check_fits(head, method: str, hidden: int) -> None:
    width = head.config.hidden_size if method == "eagle" else head.hidden_size
    if width != hidden:
        raise ConfigError(f"the draft head's hidden size {width} differs from the target's {hidden}; use a head for it")
