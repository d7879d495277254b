"""Specializations: the static shapes a package is compiled for.

A statically compiled accelerator runs only the shapes it was compiled for. qspec compiles one
*prefill* specialization and one *decode* specialization per number of speculative tokens K:

- prefill: ``seq_len = prefill_seq_len``, ``num_logits_to_keep = 1`` (speculative graphs only);
- decode for K: ``seq_len = K + 1`` (the last accepted token plus K drafts),
  ``num_logits_to_keep = K + 1`` (speculative graphs only).

The K list is sorted and de-duplicated; a specialization is dropped only when it is identical, key
for key, to one already emitted. With continuous batching (``full_batch_size`` = FBS) prefill runs
``batch_size`` rows into an FBS-slot KV cache and decode runs ``batch_size = FBS``. QEfficient's
``kv_cache_batch_size`` = N > FBS gives the KV cache N slots (the ``full_batch_size`` symbol of every
shape is then N) while decode still runs FBS rows, each picking its slot with ``batch_index``: the
extra slots keep finished requests' KV for prefix reuse.

The keys are the symbolic dimension names of the ONNX graph (:mod:`qspec.contract`). Inside qspec a
:class:`Specialization` holds integers; only the writer (:mod:`qspec.spec_file`) turns them into
the vendor's wire format: a flat, string-valued JSON file (older SDKs reject integers: the
compiler exits 255)::

    {"specializations": [
      {"batch_size": "1", "seq_len": "32", "ctx_len": "128", "num_logits_to_keep": "1"},
      {"batch_size": "1", "seq_len": "1", "ctx_len": "128", "num_logits_to_keep": "1"},
      {"batch_size": "1", "seq_len": "5", "ctx_len": "128", "num_logits_to_keep": "5"}]}

or, for newer SDKs, the "named" form ``{"name": "Decode_1", "symbols": {...}}`` (QEfficient's names).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field, field_validator, model_validator

from qspec import contract
from qspec.ccl import QEFFICIENT_MAX_CCL_SPECIALIZATIONS, CclLists, CclRule, ccl_lists
from qspec.common import FrozenModel
from qspec.errors import ConfigError

# Wire key order: the order QEfficient writes and the order a reader expects.
WIRE_KEYS = (
    contract.BATCH_SIZE,
    contract.SEQ_LEN,
    contract.CTX_LEN,
    contract.COMP_CTX_LENGTHS,
    contract.NUM_LOGITS_TO_KEEP,
    contract.FULL_BATCH_SIZE,
)
assert set(WIRE_KEYS) == set(contract.SPECIALIZATION_KEYS), WIRE_KEYS

SPECULATIVE_CONFIG_KEY = "speculative_config"
NUM_SPECULATIVE_TOKENS = "num_speculative_tokens"
_K_EXAMPLE = "give a comma-separated list such as 0,4"
_CCL_EXAMPLE = "give a comma-separated list of KV slot counts such as 256,1024"


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _parse_token(token: str, raw: str, name: str, example: str) -> int:
    """One entry of a comma-separated list, as an int."""
    token = token.strip()
    if not token:
        raise ConfigError(f"{name} {raw!r}: empty entry; {example}")
    try:
        return int(token)
    except ValueError:
        raise ConfigError(f"{name} {raw!r}: {token!r} is not an integer; {example}") from None


def _check_entry(value: object, raw: object, name: str, minimum: int, example: str) -> int:
    """An entry given as a number: an int >= ``minimum`` (bools are refused, they are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} {raw!r}: {value!r} is not an integer; {example}")
    if value < minimum:
        if name == NUM_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"{name} {raw!r}: K={value} is negative; K counts drafted tokens, use 0 for no speculation"
            )
        raise ConfigError(f"{name} {raw!r}: {value} is below {minimum}; {example}")
    return value


def parse_int_list(value: str | int | Sequence[int], name: str, *, minimum: int = 0, example: str) -> tuple[int, ...]:
    """Parse ``"0,4"``, ``"4,0,4"``, ``4`` or ``[4, 0]`` into sorted, distinct ints: ``(0, 4)``.

    Raises ConfigError, naming ``name`` and the bad value and showing ``example``, for an empty
    list, an entry that is not an integer (``"0,a"``, ``"4,,"``) or one below ``minimum``.
    """
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{name} {value!r} is empty; {example}")
        entries = [_parse_token(token, value, name, example) for token in value.split(",")]
    elif isinstance(value, int) and not isinstance(value, bool):
        entries = [value]
    elif isinstance(value, Sequence):
        entries = list(value)
    else:
        raise ConfigError(f"{name} {value!r} is neither an integer nor a list; {example}")
    if not entries:
        raise ConfigError(f"{name} {value!r} is empty; {example}")
    return tuple(sorted({_check_entry(v, value, name, minimum, example) for v in entries}))


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
    comp_ctx_lengths: int | None = Field(default=None, ge=1)  # KV slots attention reads (<= ctx_len)

    @model_validator(mode="after")
    def _check_shape(self) -> Specialization:
        if self.seq_len > self.ctx_len:
            raise ValueError(f"seq_len {self.seq_len} > ctx_len {self.ctx_len}")
        if self.comp_ctx_lengths is not None and not self.seq_len <= self.comp_ctx_lengths <= self.ctx_len:
            raise ValueError(
                f"comp_ctx_lengths {self.comp_ctx_lengths} must be in [seq_len {self.seq_len}, ctx_len {self.ctx_len}]"
            )
        if self.num_logits_to_keep is not None and self.num_logits_to_keep > self.seq_len:
            raise ValueError(
                f"num_logits_to_keep {self.num_logits_to_keep} > seq_len {self.seq_len}: "
                "a call cannot return logits for more positions than it has"
            )
        if self.full_batch_size is not None and self.full_batch_size < self.batch_size:
            raise ValueError(f"full_batch_size {self.full_batch_size} < batch_size {self.batch_size}")
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
    """Parse ``"0,4"``, ``"4,0,4"``, ``4`` or ``[4, 0]`` into sorted, distinct Ks: ``(0, 4)``."""
    return parse_int_list(value, NUM_SPECULATIVE_TOKENS, example=_K_EXAMPLE)


class SpecializationConfig(FrozenModel):
    """What the user asks to compile; :func:`build_specializations` turns it into shapes."""

    num_speculative_tokens: tuple[int, ...]
    prefill_seq_len: int = Field(default=32, ge=1)
    ctx_len: int = Field(default=128, ge=1)
    batch_size: int = Field(default=1, ge=1)
    full_batch_size: int | None = Field(default=None, ge=1)
    kv_cache_batch_size: int | None = Field(default=None, ge=1)  # KV slots, when more than full_batch_size
    speculative: bool = True  # the graph has the num_logits_to_keep input
    # Compute-context-length buckets (QEfficient's names): each prefill / decode shape is compiled once
    # per bucket and attends only to that many KV slots. ``ccl_rule`` turns the given lists into the
    # compiled buckets (qspec.ccl): "qspec" adds ctx_len, "qefficient" applies qaic-compile's rules.
    # ``ccl_auto`` (QEfficient's ccl_enabled without lists; "auto" as a list): QEfficient's lists.
    comp_ctx_lengths_prefill: tuple[int, ...] | None = None
    comp_ctx_lengths_decode: tuple[int, ...] | None = None
    ccl_rule: CclRule = "qspec"
    ccl_auto: bool = False

    @model_validator(mode="before")
    @classmethod
    def _auto_lists(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        names = ("comp_ctx_lengths_prefill", "comp_ctx_lengths_decode")
        autos = [n for n in names if isinstance(data.get(n), str) and data[n].strip().lower() == "auto"]
        if not autos:
            return data
        given = [n for n in names if n not in autos and data.get(n) is not None]
        if given:
            raise ValueError(f"{autos[0]} auto makes both lists; drop {given[0]} or give both lists")
        return {**data, **dict.fromkeys(autos), "ccl_auto": True}

    @field_validator("comp_ctx_lengths_prefill", "comp_ctx_lengths_decode", mode="before")
    @classmethod
    def _parse_ccls(cls, value: Any, info) -> tuple[int, ...] | None:
        if value is None:
            return None
        try:
            return parse_int_list(value, info.field_name, minimum=1, example=_CCL_EXAMPLE)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

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
        if self.kv_cache_batch_size is not None:
            if self.full_batch_size is None:
                raise ValueError(
                    f"kv_cache_batch_size {self.kv_cache_batch_size} needs continuous batching: give "
                    "full_batch_size too (the sequences decoded per step)"
                )
            if self.kv_cache_batch_size < self.full_batch_size:
                raise ValueError(
                    f"kv_cache_batch_size {self.kv_cache_batch_size} < full_batch_size {self.full_batch_size}: "
                    "every sequence decoded in a step needs a KV slot; raise kv_cache_batch_size"
                )
        if not self.speculative and self.num_speculative_tokens != (0,):
            raise ValueError(
                f"num_speculative_tokens {list(self.num_speculative_tokens)} needs a speculative "
                "graph (with the num_logits_to_keep input); a non-speculative graph only runs "
                "K=0: pass num_speculative_tokens=0 or export a speculative graph"
            )
        if self.ccl_rule == "qspec":  # QEfficient's rule caps and raises given values instead
            self._check_ccls(
                "comp_ctx_lengths_prefill", self.comp_ctx_lengths_prefill, self.prefill_seq_len, "prefill_seq_len"
            )
            self._check_ccls("comp_ctx_lengths_decode", self.comp_ctx_lengths_decode, k_max + 1, f"K={k_max} (seq_len)")
        if self.comp_ctx_lengths:
            try:
                lists = self.ccl_lists()
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
            self._check_buckets("prefill", lists.prefill, self.prefill_seq_len, "prefill_seq_len", lists)
            self._check_buckets("decode", lists.decode, k_max + 1, f"K={k_max} (seq_len)", lists)
        return self

    def _check_buckets(self, which: str, buckets: tuple[int, ...], smallest: int, what: str, lists: CclLists) -> None:
        """A compiled bucket must hold one call of its phase."""
        if buckets[0] < smallest:
            why = f" ({'; '.join(lists.changes)})" if lists.changes else ""
            raise ValueError(
                f"{which} bucket {buckets[0]} < {what} {smallest}{why}: a call of that shape cannot fit; "
                "give larger buckets or a smaller shape"
            )

    def _check_ccls(self, name: str, ccls: tuple[int, ...] | None, smallest: int, what: str) -> None:
        for ccl in ccls or ():
            if ccl > self.ctx_len:
                raise ValueError(f"{name} {ccl} > ctx_len {self.ctx_len}; a bucket cannot exceed the KV buffer")
            if ccl < smallest:
                raise ValueError(
                    f"{name} {ccl} < {what} {smallest}: a call of that shape cannot fit in the bucket; "
                    f"drop {ccl} or use buckets of at least {smallest}"
                )

    @property
    def continuous_batching(self) -> bool:
        """True when the KV cache has ``full_batch_size`` slots (continuous batching)."""
        return self.full_batch_size is not None

    @property
    def kv_slots(self) -> int | None:
        """KV slots of a continuous-batching cache (the shapes' ``full_batch_size`` symbol), None without one:
        ``kv_cache_batch_size`` when given, else ``full_batch_size``."""
        return self.kv_cache_batch_size or self.full_batch_size

    @property
    def comp_ctx_lengths(self) -> bool:
        """True when the graph has the ``comp_ctx_lengths`` input (a bucket list was given, or ``auto``)."""
        return self.ccl_auto or self.comp_ctx_lengths_prefill is not None or self.comp_ctx_lengths_decode is not None

    def ccl_lists(self) -> CclLists:
        """The compiled buckets of both phases under :attr:`ccl_rule`, with what the rule changed."""
        return ccl_lists(
            self.ccl_rule,
            self.comp_ctx_lengths_prefill,
            self.comp_ctx_lengths_decode,
            ctx_len=self.ctx_len,
            prefill_seq_len=self.prefill_seq_len,
            auto=self.ccl_auto,
        )

    def buckets(self, which: str) -> list[int | None]:
        """Compute context lengths of the ``prefill`` or ``decode`` shapes, ascending.

        ``[None]`` for a graph without the input. Rule ``qspec``: ``comp_ctx_lengths_decode=(256, 512)``
        with ``ctx_len=1024`` -> ``[256, 512, 1024]``; the prefill list, not given, -> ``[1024]``. Rule
        ``qefficient`` on the same: decode ``[1024]``, prefill ``[992]`` (:mod:`qspec.ccl`).
        """
        if not self.comp_ctx_lengths:
            return [None]
        lists = self.ccl_lists()
        return list(lists.prefill if which == "prefill" else lists.decode)


def make_config(**kwargs: Any) -> SpecializationConfig:
    """Build a :class:`SpecializationConfig`, raising ConfigError (one line) on bad options."""
    return SpecializationConfig.create(**kwargs)


# --------------------------------------------------------------------------------------------
# Builder
# --------------------------------------------------------------------------------------------


def prefill_specialization(config: SpecializationConfig, ccl: int | None = None) -> Specialization:
    return Specialization(
        batch_size=config.batch_size,
        seq_len=config.prefill_seq_len,
        ctx_len=config.ctx_len,
        num_logits_to_keep=1 if config.speculative else None,
        full_batch_size=config.kv_slots,
        comp_ctx_lengths=ccl,
    )


def decode_specialization(config: SpecializationConfig, k: int, ccl: int | None = None) -> Specialization:
    return Specialization(
        batch_size=config.full_batch_size or config.batch_size,
        seq_len=k + 1,
        ctx_len=config.ctx_len,
        num_logits_to_keep=k + 1 if config.speculative else None,
        full_batch_size=config.kv_slots,
        comp_ctx_lengths=ccl,
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
    carry ``full_batch_size=4``; adding ``kv_cache_batch_size=8`` keeps those batch sizes and makes both
    carry ``full_batch_size=8`` (QEfficient's specializations for the same options).

    With compute-context-length buckets, one prefill shape per prefill bucket, then the decode
    shapes of every K for each decode bucket, buckets ascending and ctx_len always one of them:
    ``ctx_len=1024``, ``comp_ctx_lengths_decode="256"`` and no prefill list give prefill at 1024,
    then K=0, K=4 at 256 and K=0, K=4 at 1024.
    """
    candidates = [prefill_specialization(config, ccl) for ccl in config.buckets("prefill")]
    candidates += [
        decode_specialization(config, k, ccl) for ccl in config.buckets("decode") for k in config.num_speculative_tokens
    ]
    specs: list[Specialization] = []
    for spec in candidates:
        if spec not in specs:
            specs.append(spec)
    return specs


def ccl_notes(config: SpecializationConfig, specs: Sequence[Specialization]) -> list[str]:
    """What the CCL rule changed, and a warning when the count passes what QEfficient's lists make.

    QEfficient compiles no K list with CCL (it raises NotImplementedError); qspec compiles every K at
    every decode bucket, so the count grows as K x buckets.
    """
    if not config.comp_ctx_lengths:
        return []
    notes = list(config.ccl_lists().changes)
    if len(specs) > QEFFICIENT_MAX_CCL_SPECIALIZATIONS:
        ks = len(config.num_speculative_tokens)
        notes.append(
            f"{len(specs)} specializations ({len(config.buckets('prefill'))} prefill buckets, {ks} K x "
            f"{len(config.buckets('decode'))} decode buckets): QEfficient's automatic lists stop at "
            f"{QEFFICIENT_MAX_CCL_SPECIALIZATIONS} and no compile of more was seen; drop buckets or Ks if "
            "qaic-compile fails"
        )
    return notes


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
        f"model config says num_speculative_tokens={model_k}; using the requested {list(ks)} and ignoring {model_k}"
    ]
