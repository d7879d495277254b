"""The qaic compile backend: Qualcomm Cloud AI 100. The package ships the fp32 vendor graph; qspec writes the
compiler's files and command (:func:`qspec.backends.qaic.prepare_qaic`) and runs it when a compiler is found.

The rule that the vendor options belong to this backend alone is :func:`refuse_qaic_options`, which the
library's options and the CLI both call.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qspec import contract
from qspec.backend_records import QaicOptions, QaicResult
from qspec.backends.base import BuiltGraph, CompileBackend, Exported, Progress
from qspec.backends.qaic import (
    CUSTOM_IO_FILE,
    DEFAULT_COMPILER,
    QPC_DIR,
    SCRIPT_FILE,
    compile_script,
    prepare_qaic,
    qaic_compile_argv,
    resolve_compiler,
    run_compiler,
    write_executable,
)
from qspec.common import write_text_atomic
from qspec.head_manifest import HEAD_ONNX
from qspec.package import ONNX_FILE, SPECIALIZATIONS_FILE

if TYPE_CHECKING:
    from qspec.compile import CompileOptions
    from qspec.head_manifest import HeadManifest
    from qspec.heads.kind import HeadKind


def qaic_options_given(options: QaicOptions) -> list[str]:
    """The qaic options that differ from their defaults, as ``num_cores=8``."""
    defaults = QaicOptions()
    return [
        f"{name}={getattr(options, name)!r}"
        for name in type(options).model_fields
        if getattr(options, name) != getattr(defaults, name)
    ]


def refuse_qaic_options(backend: str, given: list[str]) -> str | None:
    """The one-line error for qaic options (``given``: the names the user wrote) on another backend, else None.

    >>> refuse_qaic_options("ort", ["--num-cores"])
    '--num-cores: qaic-only; add --backend qaic, or drop it for the ort backend'
    """
    if backend == QaicBackend.name or not given:
        return None
    pronoun = "it" if len(given) == 1 else "them"
    return f"{', '.join(given)}: qaic-only; add --backend qaic, or drop {pronoun} for the {backend} backend"


class QaicBackend(CompileBackend):
    """Qualcomm's qaic-compile (module doc)."""

    name = "qaic"
    ships_vendor_graph = True
    ccl_rule = "qefficient"  # the CCL lists follow qaic-compile's rules (qspec.ccl), the manifest records it
    unread_options = frozenset()

    def validate(self, options: CompileOptions) -> None:
        """The vendor compiles the fp32 graph and compresses weights itself."""
        if options.weight_format != "fp32":
            raise ValueError(
                f"weight_format {options.weight_format} is for the ort backend; the qaic backend compiles the "
                "fp32 graph and compresses weights itself: use --mxfp6-matmul"
            )
        if options.draft_head_weight_format not in (None, "fp32"):
            raise ValueError(
                f"draft_head_weight_format {options.draft_head_weight_format} is for the ort backend; the qaic "
                "backend compiles the head's fp32 graph and compresses weights itself"
            )

    def input_files_digest(self, options: CompileOptions) -> str | None:
        """The user's partition file by content: an edited file rebuilds the package (a missing one fails later)."""
        path = options.qaic.mdp_config
        if path is None or not Path(path).is_file():
            return None
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()

    def prepare(
        self,
        folder: Path,
        exported: Exported,
        graph: BuiltGraph | None,
        options: CompileOptions,
        *,
        progress: Progress,
    ) -> dict[str, Any]:
        """custom_io.yaml and the qaic-compile command (run when the compiler is installed)."""
        progress("preparing the qaic-compile command")
        result = prepare_qaic(
            folder,
            onnx_path=folder / ONNX_FILE,
            specializations_path=folder / SPECIALIZATIONS_FILE,
            num_layers=exported.entry.num_layers,
            options=options.qaic,
            feature_outputs=(contract.HIDDEN_STATES,) if options.exports_hidden_states else (),
            latent=exported.entry.kv_layout == "latent",
        )
        return {"qaic": result}

    def prepare_head(
        self,
        programs: list[Path],
        kind: HeadKind,
        manifest: HeadManifest,
        options: QaicOptions,
        *,
        progress: Progress,
    ) -> HeadManifest:
        progress("preparing the head's qaic-compile command")
        results = [prepare_head_qaic(folder, kind, options) for folder in programs]
        return manifest.model_copy(update={"qaic": results[0]})


def prepare_head_qaic(head_dir: Path, kind: HeadKind, options: QaicOptions, *, run: bool | None = None) -> QaicResult:
    """Write ``custom_io.yaml`` (the kind's) and ``compile_qaic.sh`` for the head graph (paths relative to
    ``head_dir``); compile when a compiler is found (``run=None``), always (``True``) or never (``False``)."""
    write_text_atomic(head_dir / CUSTOM_IO_FILE, kind.custom_io(options.io_float_dtype))
    compiler = resolve_compiler(run)
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
