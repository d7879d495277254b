"""Load a package on a runtime backend: the one place that knows every :class:`LoadedModel` implementation, and
where a package's other graphs (a draft model's package, a draft head's graph) are opened too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from qspec.errors import ConfigError
from qspec.runtime.session import LoadedModel

if TYPE_CHECKING:
    from qspec.runtime.head_graph import HeadGraph

RUNTIME_BACKENDS = ("ort", "qaic")


def load_model(package: str | Path, *, backend: str = "ort", **options: Any) -> LoadedModel:
    """Load ``package`` on ``backend``; ``options`` go to the backend (ORT: session_mode, spinning, num_threads).

    Each backend's module is imported only when asked for (``qaic`` needs the vendor's runtime)."""
    if backend == "ort":
        from qspec.runtime.model import CompiledModel

        return CompiledModel(package, **options)
    if backend == "qaic":
        from qspec.runtime.qaic_session import QaicModel

        return QaicModel(package, **options)
    raise ConfigError(f"runtime backend {backend!r}: use one of {', '.join(RUNTIME_BACKENDS)}")


def load_head_graph(
    path: Path, *, rows: int, kv: tuple[int, int, int] | None, num_threads: int | None = 1, backend: str = "ort"
) -> HeadGraph:
    """A draft head's runtime graph at ``path`` (:class:`~qspec.runtime.head_graph.HeadGraph`), ``rows`` KV rows of
    shape ``kv`` (EAGLE). Heads run on ONNX Runtime on every backend for now: a head's QPC session would be
    opened here (the head's qaic files are in the package, :mod:`qspec.backends.qaic_compile`)."""
    if backend not in RUNTIME_BACKENDS:
        raise ConfigError(f"runtime backend {backend!r}: use one of {', '.join(RUNTIME_BACKENDS)}")
    from qspec.runtime.head_graph import HeadGraph

    return HeadGraph(path, rows=rows, kv=kv, num_threads=num_threads)
