"""Specializations: the static shapes a package is compiled for.

A statically compiled accelerator runs only the shapes it was compiled for. qspec compiles one
*prefill* specialization and one *decode* specialization per number of speculative tokens K:

- prefill: ``seq_len = prefill_seq_len``, ``num_logits_to_keep = 1`` (speculative graphs only);
- decode for K: ``seq_len = K + 1`` (the last accepted token plus K drafts),
  ``num_logits_to_keep = K + 1`` (speculative graphs only).

The K list is sorted and de-duplicated; a specialization is dropped only when it is identical, key
for key, to one already emitted. With continuous batching (``full_batch_size`` = FBS) prefill runs
``batch_size`` rows into an FBS-slot KV cache and decode runs ``batch_size = FBS``.

The keys are the symbolic dimension names of the ONNX graph (:mod:`qspec.contract`). Inside qspec a
:class:`Specialization` holds integers; only the writer turns them into the vendor's wire format:
a flat, string-valued JSON file (older SDKs reject integers: the compiler exits 255)::

    {"specializations": [
      {"batch_size": "1", "seq_len": "32", "ctx_len": "128", "num_logits_to_keep": "1"},
      {"batch_size": "1", "seq_len": "1", "ctx_len": "128", "num_logits_to_keep": "1"},
      {"batch_size": "1", "seq_len": "5", "ctx_len": "128", "num_logits_to_keep": "5"}]}

or, for newer SDKs, the "named" form ``{"name": "Decode_5", "symbols": {...}}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from qspec import contract
from qspec.common import FrozenModel, validation_message, write_text_atomic
from qspec.errors import ConfigError

SpecFormat = Literal["flat", "named"]

# Wire key order: the order QEfficient writes and the order a reader expects.
WIRE_KEYS = (
    contract.BATCH_SIZE,
    contract.SEQ_LEN,
    contract.CTX_LEN,
    contract.NUM_LOGITS_TO_KEEP,
    contract.FULL_BATCH_SIZE,
)
assert set(WIRE_KEYS) == set(contract.SPECIALIZATION_KEYS), WIRE_KEYS

PREFILL_NAME = "Prefill"
SPECULATIVE_CONFIG_KEY = "speculative_config"
NUM_SPECULATIVE_TOKENS = "num_speculative_tokens"
_K_EXAMPLE = "give a comma-separated list such as 0,4"


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _parse_k_token(token: str, raw: str) -> int:
    """One K of a comma-separated list, as an int >= 0."""
    token = token.strip()
    if not token:
        raise ConfigError(
            f"num_speculative_tokens {raw!r}: empty entry; {_K_EXAMPLE}"
        )
    try:
        return int(token)
    except ValueError:
        raise ConfigError(
            f"num_speculative_tokens {raw!r}: {token!r} is not an integer; {_K_EXAMPLE}"
        ) from None


def _check_k(k: object, raw: object) -> int:
    """A K given as a number: an int >= 0 (bools are refused, they are not counts)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigError(
            f"num_speculative_tokens {raw!r}: {k!r} is not an integer; {_K_EXAMPLE}"
        )
    if k < 0:
        raise ConfigError(
            f"num_speculative_tokens {raw!r}: K={k} is negative; K counts drafted tokens, "
            "use 0 for no speculation"
        )
    return k


# --------------------------------------------------------------------------------------------
# Typed values
# --------------------------------------------------------------------------------------------


class Specialization(FrozenModel):
    """One compiled shape; the field names are the graph's symbolic dimension names."""

    batch_size: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    ctx_len: int = Field(ge=1)
    num_logits_to_keep: int | None = Field(default=None, ge=1)
    full_batch_size: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check_shape(self) -> Specialization:
        if self.seq_len > self.ctx_len:
            raise ValueError(f"seq_len {self.seq_len} > ctx_len {self.ctx_len}")
        if self.num_logits_to_keep is not None and self.num_logits_to_keep > self.seq_len:
            raise ValueError(
                f"num_logits_to_keep {self.num_logits_to_keep} > seq_len {self.seq_len}: "
                "a call cannot return logits for more positions than it has"
            )
        if self.full_batch_size is not None and self.full_batch_size < self.batch_size:
            raise ValueError(
                f"full_batch_size {self.full_batch_size} < batch_size {self.batch_size}"
            )
        return self

    @property
    def num_speculative_tokens(self) -> int:
        """K verified by this shape as a decode specialization: ``seq_len - 1``.

        Meaningful for decode specializations only (a prefill shape has no K).
        """
        return self.seq_len - 1

    def symbols(self) -> dict[str, int]:
        """``{dimension name: size}`` of the keys this shape sets, in wire order."""
        values = self.model_dump()
        return {key: values[key] for key in WIRE_KEYS if values[key] is not None}

    def describe(self) -> str:
        """``batch_size=1 seq_len=5 ctx_len=128 num_logits_to_keep=5``: for messages and logs."""
        return " ".join(f"{key}={value}" for key, value in self.symbols().items())

    def to_wire(self) -> dict[str, str]:
        """The vendor's flat, string-valued form, in :data:`WIRE_KEYS` order, without ``None``s."""
        values = self.model_dump()
        return {key: str(values[key]) for key in WIRE_KEYS if values[key] is not None}


def parse_num_speculative_tokens(value: str | int | Sequence[int]) -> tuple[int, ...]:
    """Parse ``"0,4"``, ``"4,0,4"``, ``4`` or ``[4, 0]`` into sorted, distinct Ks: ``(0, 4)``.

    Raises ConfigError, naming the bad value and showing the fix, for an empty list, an entry
    that is not an integer (``"0,a"``, ``"4,,"``) or a negative K.
    """
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"num_speculative_tokens {value!r} is empty; {_K_EXAMPLE}")
        ks = [_parse_k_token(token, value) for token in value.split(",")]
    elif isinstance(value, int) and not isinstance(value, bool):
        ks = [value]
    elif isinstance(value, Sequence):
        ks = list(value)
    else:
        raise ConfigError(
            f"num_speculative_tokens {value!r} is neither an integer nor a list; {_K_EXAMPLE}"
        )
    if not ks:
        raise ConfigError(f"num_speculative_tokens {value!r} is empty; {_K_EXAMPLE}")
    return tuple(sorted({_check_k(k, value) for k in ks}))


class SpecializationConfig(FrozenModel):
    """What the user asks to compile; :func:`build_specializations` turns it into shapes."""

    num_speculative_tokens: tuple[int, ...]
    prefill_seq_len: int = Field(default=32, ge=1)
    ctx_len: int = Field(default=128, ge=1)
    batch_size: int = Field(default=1, ge=1)
    full_batch_size: int | None = Field(default=None, ge=1)
    speculative: bool = True  # the graph has the num_logits_to_keep input
    comp_ctx_lengths: tuple[int, ...] | None = None

    @field_validator("num_speculative_tokens", mode="before")
    @classmethod
    def _parse_ks(cls, value: Any) -> tuple[int, ...]:
        try:
            return parse_num_speculative_tokens(value)
        except ConfigError as exc:  # pydantic only collects ValueErrors
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _check_combination(self) -> SpecializationConfig:
        k_max = self.num_speculative_tokens[-1]
        if k_max + 1 > self.ctx_len:
            raise ValueError(
                f"num_speculative_tokens {k_max} needs seq_len {k_max + 1} > ctx_len "
                f"{self.ctx_len}; lower K or raise ctx_len"
            )
        if self.prefill_seq_len > self.ctx_len:
            raise ValueError(
                f"prefill_seq_len {self.prefill_seq_len} > ctx_len {self.ctx_len}; "
                "lower prefill_seq_len or raise ctx_len"
            )
        if self.full_batch_size is not None and self.full_batch_size < self.batch_size:
            raise ValueError(
                f"full_batch_size {self.full_batch_size} < batch_size {self.batch_size}: the "
                "KV cache holds full_batch_size sequences, so it must hold every prefill row; "
                "raise full_batch_size or lower batch_size"
            )
        if not self.speculative and self.num_speculative_tokens != (0,):
            raise ValueError(
                f"num_speculative_tokens {list(self.num_speculative_tokens)} needs a speculative "
                "graph (with the num_logits_to_keep input); a non-speculative graph only runs "
                "K=0: pass num_speculative_tokens=0 or export a speculative graph"
            )
        if self.comp_ctx_lengths is not None:
            raise ValueError(
                f"comp_ctx_lengths {list(self.comp_ctx_lengths)} is not supported: the qspec "
                "graph contract has no compute-context-length input, so every specialization "
                f"attends over the full ctx_len {self.ctx_len}; drop comp_ctx_lengths"
            )
        return self

    @property
    def continuous_batching(self) -> bool:
        """True when the KV cache has ``full_batch_size`` slots (continuous batching)."""
        return self.full_batch_size is not None


def make_config(**kwargs: Any) -> SpecializationConfig:
    """Build a :class:`SpecializationConfig`, raising ConfigError (one line) on bad options."""
    return SpecializationConfig.create(**kwargs)


# --------------------------------------------------------------------------------------------
# Builder
# --------------------------------------------------------------------------------------------


def _prefill_specialization(config: SpecializationConfig) -> Specialization:
    return Specialization(
        batch_size=config.batch_size,
        seq_len=config.prefill_seq_len,
        ctx_len=config.ctx_len,
        num_logits_to_keep=1 if config.speculative else None,
        full_batch_size=config.full_batch_size,
    )


def _decode_specialization(config: SpecializationConfig, k: int) -> Specialization:
    return Specialization(
        batch_size=config.full_batch_size or config.batch_size,
        seq_len=k + 1,
        ctx_len=config.ctx_len,
        num_logits_to_keep=k + 1 if config.speculative else None,
        full_batch_size=config.full_batch_size,
    )


def build_specializations(config: SpecializationConfig) -> list[Specialization]:
    """The prefill specialization, then one decode specialization per K, ascending.

    A specialization identical key for key to one already emitted is dropped (only then).

    Worked example: ``num_speculative_tokens="4,0"``, ``prefill_seq_len=32``, ``ctx_len=128``,
    ``batch_size=1``, speculative graph. Ks sort to ``(0, 4)``; the result is::

        prefill   batch_size=1 seq_len=32 ctx_len=128 num_logits_to_keep=1
        K=0       batch_size=1 seq_len=1  ctx_len=128 num_logits_to_keep=1
        K=4       batch_size=1 seq_len=5  ctx_len=128 num_logits_to_keep=5

    With ``prefill_seq_len=1`` the K=0 shape equals the prefill shape and is dropped; with
    ``prefill_seq_len=2`` and K=1 it is kept, since ``num_logits_to_keep`` is 1 vs 2. With
    ``full_batch_size=4`` prefill keeps ``batch_size=1`` and decode runs ``batch_size=4``; both
    carry ``full_batch_size=4``.
    """
    candidates = [_prefill_specialization(config)]
    candidates += [_decode_specialization(config, k) for k in config.num_speculative_tokens]
    specs: list[Specialization] = []
    for spec in candidates:
        if spec not in specs:
            specs.append(spec)
    return specs


# --------------------------------------------------------------------------------------------
# Wire format: writer and reader
# --------------------------------------------------------------------------------------------


def specialization_name(index: int, spec: Specialization) -> str:
    """Name in the named form: the first is ``Prefill``, a decode one ``Decode_{seq_len}``."""
    return PREFILL_NAME if index == 0 else f"Decode_{spec.seq_len}"


def specializations_to_json(specs: Sequence[Specialization], *, fmt: SpecFormat = "flat") -> str:
    """Render ``specs`` as the vendor file: flat (default) or named, indent 2, final newline."""
    if fmt == "flat":
        entries: list[dict[str, Any]] = [spec.to_wire() for spec in specs]
    elif fmt == "named":
        entries = [
            {"name": specialization_name(i, spec), "symbols": spec.to_wire()}
            for i, spec in enumerate(specs)
        ]
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


# --------------------------------------------------------------------------------------------
# Model config cross-check
# --------------------------------------------------------------------------------------------


def model_speculative_length(hf_config: dict[str, Any]) -> int | None:
    """``num_speculative_tokens`` of a HF config dict, top level or in ``speculative_config``."""
    nested = hf_config.get(SPECULATIVE_CONFIG_KEY)
    for source in (hf_config, nested if isinstance(nested, dict) else {}):
        value = source.get(NUM_SPECULATIVE_TOKENS)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def check_model_speculative_config(hf_config: dict[str, Any], ks: tuple[int, ...]) -> list[str]:
    """Warnings when the model config's speculative length disagrees with the requested Ks.

    The config agrees when its ``num_speculative_tokens`` is the largest requested K (K=0 and
    smaller Ks are buckets of the same drafter). The requested Ks always win.
    """
    model_k = model_speculative_length(hf_config)
    if model_k is None or model_k == max(ks):
        return []
    return [
        f"model config says num_speculative_tokens={model_k}; using the requested "
        f"{list(ks)} and ignoring {model_k}"
    ]
