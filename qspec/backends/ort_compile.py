"""The ort compile backend: ONNX Runtime on the CPU. It builds the runtime graph (:mod:`.ort_optimize`: fusions,
quantization, cached), then loads and runs every specialization of it once; a head's graph likewise."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qspec import contract
from qspec.backends.base import BuiltGraph, CompileBackend, Exported, Progress
from qspec.errors import CompileError
from qspec.package import SessionCheck, WeightFormat, attention_slack
from qspec.specializations import Specialization, SpecializationConfig

if TYPE_CHECKING:
    from qspec.backend_records import QaicOptions
    from qspec.compile import CompileOptions
    from qspec.head_manifest import HeadManifest
    from qspec.heads.kind import HeadKind


class OrtBackend(CompileBackend):
    """ONNX Runtime, CPU (module doc)."""

    name = "ort"

    def head_weight_format(self, weight_format: WeightFormat) -> WeightFormat:
        """int8 beside an fp32 target: a head call reads its weights from memory after every target call
        (docs/heads.md compares the formats); else the target's. Drafts never change greedy output."""
        return "int8" if weight_format == "fp32" else weight_format

    def before_export(self) -> None:
        # While the export runs in its own process: the runtime graph's imports (~3 s).
        threading.Thread(target=_import_runtime_graph_tools, daemon=True).start()

    def build_graph(
        self, exported: Exported, options: CompileOptions, config: SpecializationConfig, *, progress: Progress
    ) -> BuiltGraph:
        """Fused, in the options' weight format, RoPE rows for ``ctx_len`` and the longest call."""
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
            moe=exported.meta.model.moe,
        )
        return BuiltGraph(folder, graph)

    def prepare(
        self,
        folder: Path,
        exported: Exported,
        graph: BuiltGraph | None,
        options: CompileOptions,
        *,
        progress: Progress,
    ) -> dict[str, Any]:
        assert graph is not None, "the ort backend builds a runtime graph"
        return {
            "ort_checks": check_ort(
                folder / graph.graph.file, exported.specs, exported.entry.vocab_size, progress=progress
            )
        }

    def prepare_head(
        self,
        programs: list[Path],
        kind: HeadKind,
        manifest: HeadManifest,
        options: QaicOptions,
        *,
        progress: Progress,
    ) -> HeadManifest:
        progress("checking the head graph in ONNX Runtime")
        for folder in programs:
            check_head_sessions(folder, manifest)
        return manifest


def _import_runtime_graph_tools() -> None:
    import onnx_ir  # noqa: F401
    import onnxscript.rewriter.ort_fusions  # noqa: F401

    import qspec.backends.ort_optimize  # noqa: F401


def check_ort(
    onnx_path: Path, specs: list[Specialization], vocab_size: int, *, progress: Progress
) -> list[SessionCheck]:
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
            raise CompileError(f"ONNX Runtime could not run specialization {spec.describe()}: {_first(exc)}") from exc
        ran = time.perf_counter() - begin
        checks.append(SessionCheck(specialization=spec, load_seconds=round(loaded, 2), run_ms=round(ran * 1000, 1)))
        del session
    return checks


def _first(exc: Exception) -> str:
    """The first line of an ONNX Runtime error (they run to several lines)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def example_feeds(manifest: HeadManifest, spec: Specialization) -> dict[str, np.ndarray]:
    """Inputs of one call of ``spec``'s shape (its proposer's :meth:`call_feeds`: token 0, positions from 0, zero
    features) and zero KV."""
    from qspec.runtime.heads import head_proposer

    hidden = np.zeros((spec.batch_size, spec.seq_len, manifest.hidden_size), np.float32)
    feeds = head_proposer(manifest.method).call_feeds(manifest, spec, hidden)
    if manifest.kv_shape is not None:
        rows = spec.full_batch_size or spec.batch_size
        feeds |= {name: np.zeros((rows, *manifest.kv_shape), np.float32) for name in contract.kv_names(1)}
    return feeds


def check_head_sessions(folder: Path, manifest: HeadManifest) -> None:
    """Run the head's runtime graph once per specialization; the logits must have the shape the manifest says (a
    parallel head's graph with ``batch_index`` hands out its depth's rows a row)."""
    import onnxruntime as ort

    from qspec.backends import ort_plan

    session = ort.InferenceSession(str(folder / manifest.runtime_graph), providers=["CPUExecutionProvider"])
    names = {value.name for value in session.get_inputs()}
    planned = bool(ort_plan.plan_names(names))  # a one-slot EAGLE head takes the host's call plan (one kept row)
    rows = manifest.num_heads if planned else manifest.parallel_depth or manifest.num_heads
    for spec in manifest.specializations:
        feeds = example_feeds(manifest, spec)
        if planned:
            feeds |= ort_plan.feeds(feeds[contract.POSITION_IDS], 1, names)
        try:
            logits = session.run([contract.LOGITS], feeds)[0]
        except Exception as exc:  # ORT raises plain RuntimeErrors
            raise CompileError(f"the draft head graph fails for {spec.describe()}: {_first(exc)}") from exc
        want = (spec.batch_size, rows, manifest.draft_vocab_size)
        if logits.shape != want:
            raise CompileError(f"the draft head returns logits {logits.shape} for {spec.describe()}, expected {want}")
