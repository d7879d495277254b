"""The draft head inside a package: ``<package>/head/``, described by ``head.json``.

::

    <package>/head/
      head.json              HeadManifest: method, layout, sizes, files, the target's fingerprint
      head.onnx(+.data)      the head graph (the vendor's; float16-stored weights)
      head.ort.onnx(+.data)  what the runtime loads: EAGLE's with GroupQueryAttention (every format,
                             qspec.heads.ort_graph), int8/int4 with MatMulNBits weights
      draft_ids.npy          int64 [draft_vocab]: target id of each draft-vocabulary entry (reduced vocab only)
      specializations.json   the head's shapes (flat or named, as the target's)
      custom_io.yaml, compile_qaic.sh   backend "qaic" only
      layer{i}/              program i >= 1 (MTP layer i): the same graph and vendor files, one program each

It sits beside :mod:`qspec.package` (the target's manifest) and imports what that module imports: the runtime
reads it, and neither torch nor :mod:`qspec.heads` (the compile side) is imported here. ``method`` names the
runtime's proposer (:data:`qspec.runtime.heads.HEAD_PROPOSERS`), ``layout`` the checkpoint kind it was read
from (:data:`qspec.heads.kinds.KINDS`); both tables check their names, this file only records them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, ValidationError

from qspec.backend_records import QaicResult
from qspec.common import FrozenModel
from qspec.errors import PackageError
from qspec.spec_file import SpecFormat
from qspec.specializations import Specialization

HEAD_DIR = "head"
HEAD_MANIFEST = "head.json"
HEAD_ONNX = "head.onnx"
HEAD_ORT_ONNX = "head.ort.onnx"
DRAFT_IDS_FILE = "draft_ids.npy"
MASK_HIDDEN_FILE = "mask_hidden.npy"  # float32 [hidden]: a parallel EAGLE head's mask feature
HEAD_MANIFEST_VERSION = 2  # 2: EAGLE's runtime graph fused (fusions, kv_slack, rope_positions)

HeadWeightFormat = Literal["fp32", "int8", "int4"]  # MatMul weights of the runtime graph (tables: float16)


class HeadManifest(FrozenModel):
    """Contents of ``head/head.json``: everything the runtime needs to run the head, and where it came from."""

    manifest_version: int = HEAD_MANIFEST_VERSION
    method: str  # the runtime proposer (a key of qspec.runtime.heads.HEAD_PROPOSERS): eagle, medusa
    layout: str  # the checkpoint kind it was read from (a key of qspec.heads.kinds.KINDS)
    source: str  # the head folder as given
    digest: str  # hash of the head's files
    target_fingerprint: str  # the target export's key: the head reads that graph's hidden states
    hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)  # the target's
    draft_vocab_size: int = Field(ge=1)
    draft_ids_file: str | None = None  # None: the draft vocabulary is the target's (identity)
    # A parallel EAGLE head (qspec.heads.parallel): drafts per call, the mask pairs' token and feature file
    parallel_depth: int | None = Field(default=None, ge=2)
    mask_token_id: int | None = None
    mask_hidden_file: str | None = None
    num_heads: int = Field(default=1, ge=1)  # Medusa heads (tokens per call); 1 for EAGLE
    num_layers: int = Field(default=1, ge=1)  # residual blocks per Medusa head; decoder layers of EAGLE; MTP layers
    programs: int = Field(default=1, ge=1)  # head graphs: one per MTP layer (head/, head/layer{i}/), else one
    # EAGLE's own KV cache (one layer): past_key.0 / past_value.0 [rows, num_kv_heads, ctx_len, head_dim]
    num_kv_heads: int | None = None
    head_dim: int | None = None
    ctx_len: int | None = None
    full_batch_size: int | None = None
    continuous_batching: bool = False
    graph: str = HEAD_ONNX  # the vendor graph
    runtime_graph: str = HEAD_ONNX  # what ONNX Runtime loads
    fusions: dict[str, int] = Field(default_factory=dict)  # ops fused into the runtime graph, and how many
    # KV slots the runtime graph needs beyond ctx_len (GroupQueryAttention: see qspec.package.attention_slack)
    kv_slack: int = Field(default=0, ge=0)
    rope_positions: int | None = None  # rows of the runtime graph's RoPE table (GroupQueryAttention only)
    weight_format: HeadWeightFormat = "fp32"
    quantized_matmuls: int = 0
    float16_initializers: int = 0
    input_names: list[str]
    output_names: list[str]
    specializations: list[Specialization]
    specializations_file: str = "specializations.json"
    spec_format: SpecFormat = "flat"
    backend: str = "ort"  # the compile backend (qspec.backends.registry.BACKENDS)
    qaic: QaicResult | None = None
    graph_bytes: int = 0  # head.onnx and its data
    runtime_graph_bytes: int = 0
    export_seconds: float = 0.0

    @property
    def kv_shape(self) -> tuple[int, int, int] | None:
        """``(num_kv_heads, slots, head_dim)`` of each KV buffer the runtime graph reads (EAGLE), else None."""
        if self.num_kv_heads is None or self.ctx_len is None or self.head_dim is None:
            return None
        return self.num_kv_heads, self.ctx_len + self.kv_slack, self.head_dim

    def path(self, package: str | os.PathLike[str], name: str, program: int = 0) -> Path:
        """``<package>/head/<name>``; program ``i >= 1``'s (MTP layer ``i``): ``<package>/head/layer{i}/<name>``."""
        return Path(package) / HEAD_DIR / program_dir(program) / name


def program_dir(program: int) -> str:
    """The folder of head program ``program`` inside ``head/``: ``""`` for program 0, ``layer{i}`` else."""
    return f"layer{program}" if program else ""


def has_head(package: str | os.PathLike[str]) -> bool:
    return (Path(package) / HEAD_DIR / HEAD_MANIFEST).is_file()


def read_head_manifest(package: str | os.PathLike[str]) -> HeadManifest:
    """The head of ``package``, or a PackageError saying how to compile one in."""
    path = Path(package) / HEAD_DIR / HEAD_MANIFEST
    if not path.is_file():
        raise PackageError(f"package {package} has no draft head; compile it with `qspec compile ... --draft-head DIR`")
    try:
        manifest = HeadManifest.model_validate_json(path.read_text())
    except (ValidationError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise PackageError(f"{path} is corrupt ({first}); recompile the package with --draft-head") from None
    if manifest.manifest_version != HEAD_MANIFEST_VERSION:
        raise PackageError(
            f"{path} has head manifest version {manifest.manifest_version}, this qspec reads "
            f"{HEAD_MANIFEST_VERSION}; recompile the package with --draft-head"
        )
    return manifest


def check_head(package: str | os.PathLike[str]) -> HeadManifest:
    """The head's manifest, after checking that every file it names is there."""
    manifest = read_head_manifest(package)
    names = {manifest.graph, manifest.runtime_graph, manifest.specializations_file}
    if manifest.draft_ids_file:
        names.add(manifest.draft_ids_file)
    for name, program in sorted((n, i) for n in names for i in range(manifest.programs)):
        if not manifest.path(package, name, program).is_file():
            raise PackageError(
                f"the draft head of {package} is missing {name}; recompile the package with --draft-head"
            )
    return manifest


def read_draft_ids(package: str | os.PathLike[str], manifest: HeadManifest) -> np.ndarray | None:
    """int64 ``[draft_vocab]``: the target id of each draft token, or None for the full vocabulary."""
    if manifest.draft_ids_file is None:
        return None
    ids = np.load(manifest.path(package, manifest.draft_ids_file))
    if ids.shape != (manifest.draft_vocab_size,):
        raise PackageError(f"{manifest.draft_ids_file} has shape {ids.shape}, the head {manifest.draft_vocab_size}")
    return ids.astype(np.int64)
