"""Errors a user can act on. The CLI prints ``Error: <message>`` and exits 1 for any of them."""

from __future__ import annotations


class QSpecError(Exception):
    """Base of every error qspec raises for bad input; the message says what to do."""


class ConfigError(QSpecError):
    """An option or a combination of options is invalid."""


class UnsupportedModelError(QSpecError):
    """The model's architecture or a feature of it is not supported by the exporter."""


class ModelLoadError(QSpecError):
    """The model could not be found or loaded."""


class PackageError(QSpecError):
    """A compiled package is missing, corrupt or incompatible."""


class CompileError(QSpecError):
    """A backend failed to prepare or compile a specialization."""


class PromptTooLongError(QSpecError):
    """A prompt does not fit into the compiled context."""
