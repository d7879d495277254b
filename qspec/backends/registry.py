"""The table of compile backends (:class:`~qspec.backends.base.CompileBackend`), one module each.

=======  =================================  ==============================================================
name     module                             what a package holds
=======  =================================  ==============================================================
ort      :mod:`qspec.backends.ort_compile`   the runtime graph (fused, quantized), checked in ONNX Runtime
qaic     :mod:`qspec.backends.qaic_compile`  the fp32 vendor graph, custom IO and the qaic-compile command
=======  =================================  ==============================================================

The runtime's side of a backend (a loaded package) is :func:`qspec.runtime.load.load_model`.
"""

from __future__ import annotations

from qspec.backends.base import CompileBackend
from qspec.backends.ort_compile import OrtBackend
from qspec.backends.qaic_compile import QaicBackend
from qspec.errors import ConfigError

BACKENDS: dict[str, CompileBackend] = {backend.name: backend for backend in (OrtBackend(), QaicBackend())}


def compile_backend(name: str) -> CompileBackend:
    """The backend called ``name``, or a one-line error listing them."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")
    return BACKENDS[name]
