"""Plumbing every part of qspec shares: the frozen typed-value base, one-line validation messages, atomic writes
and atomically built cache folders."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from qspec.errors import ConfigError

M = TypeVar("M", bound="FrozenModel")
T = TypeVar("T")


def validation_message(exc: ValidationError) -> str:
    """One line for the first error of a pydantic ``ValidationError``, naming the field and value.

    Messages raised by our own validators are already complete and are returned as written.
    """
    err = exc.errors(include_url=False)[0]
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if err["type"] in ("value_error", "assertion_error") or not err["loc"]:
        return msg
    field = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown option {field}={err['input']!r}"
    return f"{field}={err['input']!r}: {msg}"


class FrozenModel(BaseModel):
    """Base of qspec's typed values: frozen, unknown keys refused, :meth:`create` for users."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def create(cls: type[M], **kwargs: Any) -> M:
        """Validate ``kwargs``; any problem becomes a one-line ConfigError."""
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise ConfigError(validation_message(exc)) from None


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def with_umask(path: Path, mode: int) -> None:
    """Give ``path`` (made by ``tempfile``: 0600 files, 0700 folders) ``mode`` less the user's umask, the
    permissions any other output gets: a vendor SDK running as another user can read the package."""
    os.chmod(path, mode & ~current_umask())


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        with_umask(Path(tmp), 0o666)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_directory(final: Path, build: Callable[[Path], T]) -> T:
    """Run ``build(tmp)`` in a fresh folder beside ``final``, then move it to ``final``; returns what it returned.

    A failure (an interruption too) leaves nothing behind. For caches whose entries are complete only
    with a marker file the caller checks first: a folder already at ``final`` is a broken leftover and
    is replaced.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        with_umask(tmp, 0o777)
        result = build(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
