"""A compiled package: the directory ``qspec compile`` writes and the runtime loads.

::

    <package>/
      manifest.json          what was compiled, from what, with which options and versions
      model.onnx(+.data)     the KV-explicit graph and its fp32 weights (the contract; what qaic compiles): backend
                             "qaic", or "ort" with --vendor-graph (an fp32 ort package keeps model.onnx.data, which
                             its runtime graph reads)
      model.ort.onnx(+.data) backend "ort": the graph the runtime loads (fused, maybe quantized)
      specializations.json   the vendor's flat (or named) specialization file
      tokenizer/             tokenizer.json, tokenizer_config.json (chat template)
      custom_io.yaml, compile_qaic.sh, qpc/   backend "qaic" only

This module imports neither torch nor the exporter: a package runs with onnxruntime and numpy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qspec import contract
from qspec.backend_records import QaicResult
from qspec.common import with_umask
from qspec.errors import PackageError
from qspec.spec_file import SpecFormat, read_specializations
from qspec.specializations import Specialization, SpecializationConfig

MANIFEST = "manifest.json"
ONNX_FILE = "model.onnx"
ORT_ONNX_FILE = "model.ort.onnx"
SPECIALIZATIONS_FILE = "specializations.json"
TOKENIZER_DIR = "tokenizer"
MANIFEST_VERSION = 1

Backend = str  # a name of qspec.backends.registry.BACKENDS, checked where compile options are made
# Precision of the MatMul weights in the graph the runtime loads (int8/int4: MatMulNBits, weight-only).
WeightFormat = Literal["fp32", "int8", "int4"]
# GroupQueryAttention's query tokens per row, at least (qspec.backends.ort_attention pads one-token calls):
# ONNX Runtime rounds a lone query token differently from the same token among several.
MIN_QUERY_TOKENS = 2


def attention_slack(longest_seq_len: int) -> int:
    """KV slots a GroupQueryAttention graph needs beyond ``ctx_len`` for calls of up to ``longest_seq_len``
    tokens (and RoPE rows beyond it): a whole padded chunk of ``max(seq_len, MIN_QUERY_TOKENS)`` tokens
    past a row's first position."""
    return max(longest_seq_len, MIN_QUERY_TOKENS)


class AttentionInfo(BaseModel):
    """How the model attends, for a runtime that fuses attention into one op (RoPE table, heads, windows)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # of q.k
    windows: list[int | None]  # sliding window of each layer (keys in [p - window + 1, p]), None: all
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (weights model.layers.{i}.self_attn.{q,k}_norm)
    qk_norm_eps: float = 1e-6
    qk_norm_full: bool = False  # RMSNorm of q and k over all heads before the split (OLMo 2), same weight names
    softcap: float = 0.0  # scores soft-capped to c * tanh(s / c) (Gemma 2); 0: none
    inv_freq: list[float]  # RoPE frequencies, [head_dim / 2]
    rope_scaling: float = 1.0  # multiplies cos and sin


class MoEInfo(BaseModel):
    """The mixture-of-experts blocks the runtime graph runs as ONNX Runtime's ``MoE`` / ``QMoE`` operator
    (:mod:`qspec.backends.ort_moe`), and who routes them: ``"softmax"``, the operator from the router's logits as
    the model does (softmax over the experts, top-k, the k weights renormalised or not: Mixtral, Qwen3-MoE);
    ``"table"``, the graph's own routing table (DeepSeek-V3's group-limited sigmoid routing), the operator
    handed the chosen experts and their weights."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: list[int]  # the layers whose MLP is such a block
    num_experts: int
    top_k: int
    normalize: bool  # the top-k weights divided by their sum (by the operator: "softmax"; in the table: "table")
    routing: Literal["softmax", "table"] = "softmax"


class ModelInfo(BaseModel):
    """What the runtime needs to know about an exported model, without loading it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    value_head_dim: int | None = None  # the value buffers' width when it is not head_dim (DeepSeek's MLA)
    # "heads": past_key.{i} / past_value.{i} per KV head; "latent": DeepSeek's MLA cache as QEfficient holds it,
    # compressed_kv.{i} [rows, 1, ctx, kv_lora_rank] (head_dim) and k_pe.{i} [rows, 1, ctx, rope] (value_head_dim)
    kv_layout: Literal["heads", "latent"] = "heads"
    kv_dtype: str = "float32"
    eos_token_ids: list[int]
    speculative_config: dict = Field(default_factory=dict)  # the model config's own speculative fields
    attention: AttentionInfo | None = None  # exports before format 4 have none
    moe: MoEInfo | None = None  # MoE blocks the runtime graph runs as the MoE operator; None: none

    def kv_widths(self) -> list[int]:
        """The last dimension of each KV buffer, in :meth:`kv_names` order (key, value per layer)."""
        return [self.head_dim, self.value_head_dim or self.head_dim] * self.num_layers

    def kv_names(self) -> list[str]:
        """The KV buffers' input names (:func:`qspec.contract.kv_names` of this model's layout).

        Example, 2 layers: ``past_key.0, past_value.0, past_key.1, past_value.1``; DeepSeek-V3's latent cache
        ``compressed_kv.0, k_pe.0, compressed_kv.1, k_pe.1``.
        """
        return contract.kv_names(self.num_layers, latent=self.kv_layout == "latent")


class ModelEntry(ModelInfo):
    """The exported model in a package: its :class:`ModelInfo`, where it came from, the graph variant."""

    source: str
    digest: str
    export_key: str
    continuous_batching: bool
    comp_ctx_lengths: bool = False  # the graph has the `comp_ctx_lengths` input
    tree_inputs: bool = False  # the vendor graph has `write_slots`, `tree_mask` and `kv_moves` (trees verify on it)
    hidden_states: bool = False  # the graphs have the `hidden_states` output (a draft head reads it)
    speculative: bool
    truncated_layers: int | None = None


# RuntimeGraph.fusions keys of the two graph rewrites after which MatMuls run on live tokens only:
# qspec.backends.ort_attention packs the rows' live tokens (continuous batching) or trims one row's padding.
PACKED_TOKENS = "live_tokens"
TRIMMED_ROWS = "trimmed_rows"
# A package without drafts: a one-token call's attention runs its token alone (no exactness pad).
LONE_QUERY = "lone_query"
# Attention reads each token's ancestors only, at its depth's RoPE position: a verify row may be a tree.
TREE_ATTENTION = "tree_attention"
TREE_LANES_MAX = 16  # the widest softmax lane group a tree graph leaves KV room for (qspec.backends.ort_plan)


class RuntimeGraph(BaseModel):
    """The graph the embedded runtime loads instead of ``model.onnx``, and how it was made."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str = ORT_ONNX_FILE
    # Its external data: its own weights (all of them, or fp32's packed q/k/v) ...
    data_file: str = ORT_ONNX_FILE + ".data"
    # ... and, in fp32, the vendor graph's model.onnx.data for every other weight (stored once).
    vendor_data_file: str | None = None
    weight_format: WeightFormat
    fusions: dict[str, int] = Field(default_factory=dict)
    quantized_matmuls: int = 0
    block_size: int | None = None
    accuracy_level: int | None = None
    symmetric: bool | None = None  # quantized blocks: a scale only (True) or a scale and a zero point
    # GGUF type -> MatMul weights (and tables) whose blocks were carried over from the GGUF source as they are
    gguf_blocks: dict[str, int] = Field(default_factory=dict)
    # initializer bytes a one-token call reads (embedding tables excluded; of a MoE operator's experts, the top-k a
    # token is routed to: k=2 of 8 experts counts 2/8 of them; qspec.backends.ort_optimize.streamed_weight_bytes)
    weight_bytes: int
    # Set when attention is ONNX Runtime's GroupQueryAttention (qspec.backends.ort_attention): the rows of
    # its RoPE table, positions below it.
    rope_positions: int | None = None
    seconds: float

    @property
    def packs_live_tokens(self) -> bool:
        """Its MatMuls run on live tokens only: a call costs its live tokens, not ``rows * (K + 1)``."""
        return bool(self.fusions.get(PACKED_TOKENS) or self.fusions.get(TRIMMED_ROWS))

    @property
    def verifies_trees(self) -> bool:
        """A verify row may be a tree of drafts (:mod:`qspec.runtime.layout`; ``fuse_attention(tree=True)``)."""
        return bool(self.fusions.get(TREE_ATTENTION))

    def kv_slack(self, longest_seq_len: int) -> int:
        """Slots the runtime's KV buffers need beyond ``ctx_len`` for calls of up to ``longest_seq_len`` tokens:
        :func:`attention_slack` for a GroupQueryAttention graph; the vendor graph's attention needs none."""
        if self.rope_positions is None:
            return 0
        # a tree's off-chain draft runs up to a lane group past the chain (qspec.backends.ort_plan.op_slots)
        return attention_slack(longest_seq_len) + (TREE_LANES_MAX if self.verifies_trees else 0)


class SessionCheck(BaseModel):
    """One specialization's ONNX Runtime check at compile time, which it passed: a specialization that does
    not load or run, or gives logits of another shape, fails the compile (:func:`qspec.compile.check_ort`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    specialization: Specialization
    load_seconds: float
    run_ms: float

    @model_validator(mode="before")
    @classmethod
    def _read_older_manifests(cls, data: Any) -> Any:
        # Older manifests recorded `ok`, always true: a failed check never reached a manifest.
        return without_keys(data, "ok")


class Manifest(BaseModel):
    """Contents of ``manifest.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    manifest_version: int = MANIFEST_VERSION
    inputs_key: str  # hash of everything the package was built from: equal key, reusable package
    created: str
    model: ModelEntry
    config: SpecializationConfig
    specializations: list[Specialization]
    spec_format: SpecFormat
    backend: Backend
    vendor_graph: bool = True  # the package holds model.onnx (older packages always did)
    runtime_graph: RuntimeGraph | None = None  # None: the runtime loads model.onnx
    ort_checks: list[SessionCheck] = Field(default_factory=list)
    qaic: QaicResult | None = None  # backend "qaic" only
    versions: dict[str, str]
    compile_seconds: float
    warnings: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _read_older_manifests(cls, data: Any) -> Any:
        # Older manifests also recorded the weight format here, beside the runtime graph's.
        return without_keys(data, "weight_format")

    @property
    def weight_format(self) -> WeightFormat:
        """The precision of the MatMul weights the runtime loads: the runtime graph's; a package without one
        (backend qaic) holds the fp32 vendor graph only."""
        return self.runtime_graph.weight_format if self.runtime_graph is not None else "fp32"


def without_keys(data: Any, *keys: str) -> Any:
    """``data`` without ``keys`` when it is a dict (a field older manifests recorded and this qspec drops)."""
    return {k: v for k, v in data.items() if k not in keys} if isinstance(data, dict) else data


def read_manifest(package: str | os.PathLike[str]) -> Manifest:
    """The manifest of ``package``, or a PackageError that says what is wrong and what to do."""
    folder = Path(package)
    hint = f"run `qspec compile` to (re)build {folder}"
    if not folder.is_dir():
        raise PackageError(f"package {folder} does not exist; {hint}")
    path = folder / MANIFEST
    if not path.is_file():
        raise PackageError(f"{folder} is not a qspec package (no {MANIFEST}); {hint}")
    try:
        manifest = Manifest.model_validate_json(path.read_text())
    except (ValidationError, ValueError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise PackageError(f"{path} is corrupt ({first}); {hint}") from None
    if manifest.manifest_version != MANIFEST_VERSION:
        raise PackageError(
            f"{path} has manifest version {manifest.manifest_version}, this qspec reads {MANIFEST_VERSION}; {hint}"
        )
    return manifest


def runtime_graph_file(manifest: Manifest) -> str:
    """The graph file the runtime loads: the backend's optimized graph, else the vendor graph."""
    return manifest.runtime_graph.file if manifest.runtime_graph else ONNX_FILE


def check_package(package: str | os.PathLike[str]) -> Manifest:
    """Read the manifest and check that every file it relies on is there and agrees with it."""
    folder = Path(package)
    manifest = read_manifest(folder)
    hint = f"run `qspec compile` to rebuild {folder}"
    files = [runtime_graph_file(manifest), SPECIALIZATIONS_FILE, f"{TOKENIZER_DIR}/tokenizer.json"]
    if manifest.vendor_graph:
        files.insert(0, ONNX_FILE)
    if manifest.runtime_graph is not None:
        files.append(manifest.runtime_graph.data_file)
        if manifest.runtime_graph.vendor_data_file:
            files.append(manifest.runtime_graph.vendor_data_file)
    for name in files:
        if not (folder / name).is_file():
            raise PackageError(f"package {folder} is missing {name}; {hint}")
    graph_file = folder / runtime_graph_file(manifest)
    if graph_file.stat().st_size == 0:
        raise PackageError(f"{graph_file} is empty; {hint}")
    try:
        specs = read_specializations(folder / SPECIALIZATIONS_FILE)
    except Exception as exc:
        raise PackageError(f"{folder / SPECIALIZATIONS_FILE}: {exc}; {hint}") from None
    if specs != manifest.specializations:
        raise PackageError(f"{folder / SPECIALIZATIONS_FILE} disagrees with {MANIFEST}; {hint}")
    bucketed = any(spec.comp_ctx_lengths for spec in specs)
    if bucketed != manifest.model.comp_ctx_lengths:
        has = "has" if manifest.model.comp_ctx_lengths else "has no"
        raise PackageError(
            f"{folder}: the graph {has} a comp_ctx_lengths input but the specializations "
            f"{'carry' if bucketed else 'lack'} compute context lengths; "
            f"{hint} with the same --comp-ctx-lengths-* options"
        )
    return manifest


def write_package_atomic(target: Path, build: Callable[[Path], None]) -> None:
    """Run ``build(tmp_dir)`` and move the result to ``target``; a failure leaves ``target`` as it was.

    ``target`` may hold an older package (it is replaced) or not exist; anything else there is
    refused, so a typo in ``--output`` never deletes a user's folder.
    """
    target = Path(target).absolute()
    if target.exists() and not (target / MANIFEST).is_file():
        if not target.is_dir() or any(target.iterdir()):
            raise PackageError(f"{target} exists and is not a qspec package; choose another --output or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    old = None
    try:
        with_umask(tmp, 0o777)
        build(tmp)
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not target.exists():
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def dump_manifest(manifest: Manifest, folder: Path) -> None:
    (folder / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """A short, JSON-able view of a manifest for CLI output."""
    return json.loads(
        json.dumps(
            {
                "model": manifest.model.source,
                "backend": manifest.backend,
                "weight_format": manifest.weight_format,
                "specializations": [s.symbols() for s in manifest.specializations],
                "compile_seconds": manifest.compile_seconds,
            }
        )
    )


class ResidentMemory(BaseModel):
    """A package loaded on ONNX Runtime (``qspec info --memory``): resident bytes, measured in a child process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    process_bytes: int  # the whole process after load (interpreter, libraries, weights, pre-packed copies, KV)
    load_bytes: int  # what the load added: weights as ONNX Runtime holds them, its pre-packed copies, the KV
    kv_bytes: int  # the KV buffers (ctx_len + slack slots, every KV row), part of load_bytes
    load_seconds: float
