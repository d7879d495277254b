"""The compile-side backend seam: what one target does with an exported model (validate the options, build its
graph, prepare the package, prepare a draft head). One class per backend, one entry in
:data:`qspec.backends.registry.BACKENDS`; :mod:`qspec.compile` and :mod:`qspec.heads.package` call nothing else.

The records compile hands a backend (:class:`Exported`, :class:`BuiltGraph`) live here too. What a backend
leaves in the manifest is a dict of :class:`~qspec.package.Manifest` fields (``ort_checks``, ``qaic``), as a
head kind's :meth:`~qspec.heads.kind.HeadKind.manifest_fields`.

Example, a backend ``foo`` that ships the vendor graph and writes its own command::

    class FooBackend(CompileBackend):
        name, ships_vendor_graph = "foo", True
        def prepare(self, folder, exported, graph, options, *, progress):
            (folder / "compile_foo.sh").write_text("foo-compile model.onnx\\n")
            return {}
        def prepare_head(self, programs, kind, manifest, options, *, progress):
            return manifest

and one line in ``BACKENDS`` (``tests/test_seams.py`` adds such a backend and a head kind through the tables).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from qspec.package import ModelEntry, RuntimeGraph, WeightFormat
from qspec.specializations import Specialization, SpecializationConfig

if TYPE_CHECKING:
    from qspec.backend_records import QaicOptions
    from qspec.compile import CompileOptions
    from qspec.export.exporter import ExportMeta
    from qspec.head_manifest import HeadManifest
    from qspec.heads.kind import HeadKind

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Exported:
    """What the export phase hands on: the export folder and its record, the package's model entry, the
    specializations to build and the warnings about them."""

    folder: Path
    meta: ExportMeta
    entry: ModelEntry
    specs: list[Specialization]
    warnings: list[str]
    gguf: Path | None  # the GGUF file the model came from: its blocks may be carried into an int8/int4 graph


@dataclass(frozen=True)
class BuiltGraph:
    """A runtime graph a backend built (ort): the cache folder holding its files, and how it was made."""

    folder: Path
    graph: RuntimeGraph


class CompileBackend(ABC):
    """One compile target (module doc). Class attributes say what it needs; methods do its steps."""

    name: ClassVar[str]  # CompileOptions.backend, Manifest.backend
    # The package holds model.onnx and its fp32 weights whatever --vendor-graph says (what a vendor compiles).
    ships_vendor_graph: ClassVar[bool] = False
    # The CCL rule its compiler imposes on the specializations (qspec.ccl), None: the user's.
    ccl_rule: ClassVar[str | None] = None
    # CompileOptions fields the backend never reads: left out of the package's inputs key.
    unread_options: ClassVar[frozenset[str]] = frozenset({"qaic"})

    def validate(self, options: CompileOptions) -> None:
        """Refuse options this backend cannot build (a ValueError naming the option and the fix)."""

    def head_weight_format(self, weight_format: WeightFormat) -> WeightFormat:
        """The draft head's MatMul weights when the user names none: the target's."""
        return weight_format

    def input_files_digest(self, options: CompileOptions) -> str | None:
        """A digest of the user's files the backend reads (a partition config), for the inputs key."""
        return None

    def before_export(self) -> None:
        """Called as the export starts (in its own process): warm what the next step imports."""

    def build_graph(
        self, exported: Exported, options: CompileOptions, config: SpecializationConfig, *, progress: Progress
    ) -> BuiltGraph | None:
        """The graph the embedded runtime loads (cached), None when the runtime loads the vendor graph."""
        return None

    @abstractmethod
    def prepare(
        self,
        folder: Path,
        exported: Exported,
        graph: BuiltGraph | None,
        options: CompileOptions,
        *,
        progress: Progress,
    ) -> dict[str, Any]:
        """Check or compile the written package in ``folder``; the manifest fields it records."""

    @abstractmethod
    def prepare_head(
        self,
        programs: list[Path],
        kind: HeadKind,
        manifest: HeadManifest,
        options: QaicOptions,
        *,
        progress: Progress,
    ) -> HeadManifest:
        """Check or compile the head's programs (``head/``, ``head/layer{i}/``); its manifest with the backend's
        fields. ``options``: the vendor options of the compile (:class:`~qspec.backend_records.QaicOptions`)."""
