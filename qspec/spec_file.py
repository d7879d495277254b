"""The vendor's ``specializations.json``: the writer (flat or named, string values) and the reader.

Flat (the default: older SDKs accept nothing else)::

    {"specializations": [{"batch_size": "1", "seq_len": "32", "ctx_len": "128", "num_logits_to_keep": "1"}, ...]}

Named (newer SDKs; QEfficient 1.22 writes only this): ``{"specializations": [{"name": "Decode_1", "symbols":
{...}}, ...]}``. The reader
takes both, with string or integer values, and gives :class:`~qspec.specializations.Specialization` s.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from qspec.common import FrozenModel, validation_message, write_text_atomic
from qspec.errors import ConfigError
from qspec.specializations import Specialization, SpecializationConfig, build_specializations

SpecFormat = Literal["flat", "named"]
PREFILL_NAME = "Prefill"
DECODE_NAME = "Decode"


def specialization_names(specs: Sequence[Specialization]) -> list[str]:
    """Names in the named form, as QEfficient 1.22 gives them (``to_named_specializations``).

    ``Prefill`` for the leading prefill shapes (shaped like the first: same rows, seq_len, logits
    kept), ``Decode`` for the others; a name used more than once gets positional suffixes, the first
    one included: K ``[0, 4]`` -> ``Prefill, Decode_0, Decode_1``; with two prefill buckets
    ``Prefill_0, Prefill_1``. Nothing reads the names: the runtime picks a shape by its buffers.
    """
    first = specs[0] if specs else None
    bases, prefill = [], True
    for spec in specs:
        prefill = prefill and (spec.batch_size, spec.seq_len, spec.num_logits_to_keep) == (
            first.batch_size,
            first.seq_len,
            first.num_logits_to_keep,
        )
        bases.append(PREFILL_NAME if prefill else DECODE_NAME)
    counts = Counter(bases)
    seen: Counter[str] = Counter()
    names = []
    for base in bases:
        names.append(f"{base}_{seen[base]}" if counts[base] > 1 else base)
        seen[base] += 1
    return names


def specializations_to_json(specs: Sequence[Specialization], *, fmt: SpecFormat = "flat") -> str:
    """Render ``specs`` as the vendor file: flat (default) or named, indent 2, final newline."""
    if fmt == "flat":
        entries: list[dict[str, Any]] = [spec.to_wire() for spec in specs]
    elif fmt == "named":
        entries = [{"name": name, "symbols": spec.to_wire()} for name, spec in zip(specialization_names(specs), specs)]
    else:
        raise ConfigError(f"specialization format {fmt!r} is unknown; use 'flat' or 'named'")
    return json.dumps({"specializations": entries}, indent=2) + "\n"


def write_specializations(
    specs: Sequence[Specialization], path: str | os.PathLike[str], *, fmt: SpecFormat = "flat"
) -> Path:
    """Write the vendor file to ``path`` atomically; returns the path."""
    path = Path(path)
    write_text_atomic(path, specializations_to_json(specs, fmt=fmt))
    return path


class SpecializationsFile(FrozenModel):
    """A specializations file to write: the shapes of ``config`` in ``spec_format`` (``flat`` or ``named``)."""

    config: SpecializationConfig
    spec_format: SpecFormat = "flat"

    def specializations(self) -> list[Specialization]:
        return build_specializations(self.config)

    def to_json(self) -> str:
        return specializations_to_json(self.specializations(), fmt=self.spec_format)

    def write(self, path: str | os.PathLike[str]) -> list[Specialization]:
        """Write the file atomically; returns the specializations written."""
        specs = self.specializations()
        write_specializations(specs, path, fmt=self.spec_format)
        return specs


def _refuse_bool(key: str, value: object) -> object:
    """JSON true/false is not a size, though pydantic would take it as 1/0."""
    if isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is not an integer")
    return value


def _entry_symbols(entry: object) -> dict[str, object]:
    """The key/value symbols of one entry, flat or named."""
    if not isinstance(entry, dict):
        raise ValueError(f"is {type(entry).__name__}, expected an object")
    if "symbols" not in entry:
        return entry
    if not set(entry) <= {"name", "symbols"} or not isinstance(entry["symbols"], dict):
        raise ValueError('a named entry is {"name": ..., "symbols": {...}}')
    return entry["symbols"]


def _specialization_from_wire(entry: object, index: int) -> Specialization:
    try:
        symbols = _entry_symbols(entry)
        return Specialization(**{key: _refuse_bool(key, value) for key, value in symbols.items()})
    except ValidationError as exc:
        raise ValueError(f"entry {index}: {validation_message(exc)}") from None
    except ValueError as exc:
        raise ValueError(f"entry {index}: {exc}") from None


def _load_wire(path_or_text: str | os.PathLike[str]) -> tuple[str, object]:
    """(name for messages, parsed JSON) of a file path or of JSON text."""
    if isinstance(path_or_text, str) and path_or_text.lstrip().startswith("{"):
        source, text = "<text>", path_or_text
    else:
        source = str(path_or_text)
        try:
            text = Path(path_or_text).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"specializations file {source}: cannot read it ({exc})") from None
    try:
        return source, json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"specializations file {source}: not valid JSON ({exc})") from None


def read_specializations(path_or_text: str | os.PathLike[str]) -> list[Specialization]:
    """Read a specializations file (a path, or JSON text), flat or named, string or int values.

    Raises ConfigError with one line naming the file and what is wrong.
    """
    source, data = _load_wire(path_or_text)
    try:
        if not isinstance(data, dict) or not isinstance(data.get("specializations"), list):
            raise ValueError('expected {"specializations": [...]} at top level')
        entries = data["specializations"]
        if not entries:
            raise ValueError("the specializations list is empty")
        return [_specialization_from_wire(entry, i) for i, entry in enumerate(entries)]
    except ValueError as exc:
        raise ConfigError(f"specializations file {source}: {exc}") from None
