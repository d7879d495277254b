"""Load a package on a runtime backend: the one place that knows every :class:`LoadedModel` implementation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qspec.errors import ConfigError
from qspec.runtime.session import LoadedModel

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
