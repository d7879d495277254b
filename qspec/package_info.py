"""What a package holds, for ``qspec info``: :func:`package_info` reads the manifest, the head's manifest and
the files, and names the ``--method`` values the package runs (the runtime's proposer table, which is why this
lives above :mod:`qspec.package` and :mod:`qspec.runtime`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from qspec.package import Backend, ResidentMemory, WeightFormat, read_manifest


class PackageInfo(BaseModel):
    """What a package holds, for ``qspec info``: the model, the shapes, the formats, the files."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    package: str
    model: str
    model_type: str
    num_layers: int
    vocab_size: int
    backend: Backend
    weight_format: WeightFormat
    num_speculative_tokens: list[int]
    ctx_len: int
    prefill_seq_len: int
    kv_slots: int
    specializations: list[str]
    files: dict[str, int]  # relative path -> bytes
    total_bytes: int  # bytes on disk: every file of the package
    created: str
    resident: ResidentMemory | None = None  # with --memory
    hidden_states: bool = False  # the graphs return the final-norm hidden states (what a head reads)
    head: dict[str, Any] | None = None  # the draft head: kind, layout, draft vocabulary, format, taps
    methods: list[str] = []  # the --method values this package runs (draft also needs --draft-package)


def _head_summary(folder: Path) -> dict[str, Any] | None:
    """The fields of ``head/head.json`` a user asks about, or None without a head."""
    from qspec.head_manifest import has_head, read_head_manifest

    if not has_head(folder):
        return None
    head = read_head_manifest(folder)
    summary = {
        "kind": head.method,
        "layout": head.layout,
        "draft_vocab_size": head.draft_vocab_size,
        "vocab_size": head.vocab_size,
        "weight_format": head.weight_format,
        "num_heads": head.num_heads,
        "num_layers": head.num_layers,
    }
    taps = getattr(head, "taps", None)  # the target layers a head reads (EAGLE-3), where the manifest has them
    return summary | ({"taps": list(taps)} if taps else {})


def accepted_methods(head_kind: str | None) -> list[str]:
    """The speculative methods a package runs: every package the model-free ones, a package with a head
    that head's method alone and with prompt lookup (``user`` needs Python, so it is left out).

    >>> accepted_methods("eagle")
    ['none', 'pld', 'suffix', 'draft', 'eagle', 'eagle+pld']
    """
    from qspec.runtime.proposers import HEAD_METHODS, PROPOSER_METHODS

    plain = [m for m in PROPOSER_METHODS if m not in HEAD_METHODS and m != "user"]
    return plain + [m for m in HEAD_METHODS if head_kind is not None and m.split("+")[0] == head_kind]


def package_info(package: str | os.PathLike[str], *, memory: bool = False) -> PackageInfo:
    """The :class:`PackageInfo` of ``package`` (a PackageError if it is not one); ``memory``: also load it on ONNX
    Runtime in a child process and measure its resident memory (:mod:`qspec.backends.ort_memory`)."""
    folder = Path(package)
    manifest = read_manifest(folder)
    config = manifest.config
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    head = _head_summary(folder)
    return PackageInfo(
        package=str(folder),
        model=manifest.model.source,
        model_type=manifest.model.model_type,
        num_layers=manifest.model.num_layers,
        vocab_size=manifest.model.vocab_size,
        backend=manifest.backend,
        weight_format=manifest.weight_format,
        num_speculative_tokens=list(config.num_speculative_tokens),
        ctx_len=config.ctx_len,
        prefill_seq_len=config.prefill_seq_len,
        kv_slots=config.kv_slots or config.batch_size,
        specializations=[spec.describe() for spec in manifest.specializations],
        files=files,
        total_bytes=sum(files.values()),
        created=manifest.created,
        resident=_resident(folder) if memory else None,
        hidden_states=manifest.model.hidden_states,
        head=head,
        methods=accepted_methods(head["kind"] if head else None),
    )


def _resident(folder: Path) -> ResidentMemory:
    from qspec.runtime.memory import resident_after_load

    return resident_after_load(folder)
