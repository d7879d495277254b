"""What a bench run measures: :class:`BenchOptions` and its two presets (quick, full)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from qspec.common import FrozenModel
from qspec.errors import ConfigError
from qspec.package import WeightFormat
from qspec.runtime.proposers import HEAD_METHODS
from qspec.specializations import parse_num_speculative_tokens

SPECULATIVE_METHODS = ("pld", "suffix", "draft")
# HEAD_METHODS (eagle, medusa, eagle+pld, medusa+pld): the target package's draft head (``draft_head``)
WEIGHT_FORMATS = ("fp32", "int8", "int4")  # qspec compile --weight-format
DEFAULT_PREFILL_CHUNK_SIZES = (16, 32, 64, 128, 256)


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    """``"1,4"``, ``4`` or ``[1, 4]`` as a tuple of ints."""
    if isinstance(value, str):
        try:
            return tuple(int(token) for token in value.split(",") if token.strip())
        except ValueError:
            raise ValueError(f"{what} {value!r}: give comma-separated integers such as 1,4") from None
    if isinstance(value, int):
        return (value,)
    return tuple(value)


class BenchOptions(FrozenModel):
    """What ``qspec bench`` runs; :func:`quick_options` and :func:`full_options` are the presets."""

    prompts: Path | None = None  # JSONL of prompts; None: MT-bench
    per_category: int | None = Field(default=2, ge=1)  # first N prompts of each category; None: all
    # Configurations at batch > 1: the first N prompts of each category (None: all; never fewer than
    # per_category), a round's share in one continuous-batching run. A run drains at its end (its last
    # requests decode with slots empty), and speculation's rows finish at different times where
    # none's run in lockstep: with few requests per run the drain is a large share of it.
    batch_per_category: int | None = Field(default=10, ge=1)
    turns: int = Field(default=1, ge=1, le=2)
    max_new_tokens: int = Field(default=128, ge=1)
    batch_sizes: tuple[int, ...] = (1, 4)
    methods: tuple[str, ...] = ("pld", "suffix")
    k_lists: tuple[tuple[int, ...], ...] = ((4,), (0, 4), (0, 1, 2, 4, 8))
    baselines: bool = True  # transformers greedy and prompt lookup, batch 1
    peers: bool = True  # ONNX Runtime GenAI and llama.cpp, batch 1, where installed (qspec[peers])
    memory: bool = True  # peak RSS per configuration, one process each
    # The project's analysis beside the measurement: micro-benchmarks, head replays, speculation ceilings (what
    # bench/targets.py reads). Off: the run measures as `vllm bench` does, configurations and memory only.
    analysis: bool = False
    micro_iterations: int = Field(default=20, ge=0)  # calls per specialization; 0: no micro-benchmark
    # TTFT per prefill chunk size (the micro phase): each batch-1 package run with these sizes
    # (None: DEFAULT_PREFILL_CHUNK_SIZES up to what the packages take; empty: no sweep).
    prefill_chunk_sizes: tuple[int, ...] | None = None
    round_size: int = Field(default=8, ge=1)
    ctx_len: int = Field(default=1024, ge=2)
    prefill_seq_len: int = Field(default=64, ge=1)  # the CLI default, chosen by TTFT (cli/common.py)
    # Compute-context-length buckets of the packages the bench compiles ("" or None: none).
    comp_ctx_lengths_prefill: str | None = "256"
    comp_ctx_lengths_decode: str | None = "256,512"
    draft_package: Path | None = None
    # A draft head checkpoint (EAGLE-1, EAGLE-3, Medusa, turbo) compiled into every package the bench compiles
    # (qspec compile --draft-head); its method and its +pld combination run where pld runs.
    draft_head: Path | None = None
    num_threads: int | None = Field(default=None, ge=1)
    packages_dir: Path | None = None  # None: <qspec cache>/bench-packages
    dispatch: Literal["auto", "cover", "cost"] = "auto"  # how speculative configurations pick K
    # Head methods at batch 1 run at each width (2: the head's runner-up verified beside the chain, a tree).
    tree_widths: tuple[int, ...] = (1,)
    # One package set per format; fp32 first and always (quantized formats: batch 1, none and variable K).
    weight_formats: tuple[WeightFormat, ...] = ("fp32", "int4")

    @field_validator("batch_sizes", mode="before")
    @classmethod
    def _parse_batch_sizes(cls, value: Any) -> tuple[int, ...]:
        sizes = _int_list(value, "batch_sizes")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"batch_sizes {value!r}: give sizes >= 1, such as 1,4")
        return tuple(sorted(set(sizes)))

    @field_validator("prefill_chunk_sizes", mode="before")
    @classmethod
    def _parse_prefill_chunk_sizes(cls, value: Any) -> tuple[int, ...] | None:
        if value is None:
            return None
        sizes = _int_list(value, "prefill_chunk_sizes")
        if sizes and min(sizes) < 1:
            raise ValueError(f"prefill_chunk_sizes {value!r}: give sizes >= 1, such as 32,64,128")
        return tuple(sorted(set(sizes)))

    @field_validator("methods", mode="before")
    @classmethod
    def _parse_methods(cls, value: Any) -> tuple[str, ...]:
        names = [m.strip() for m in value.split(",")] if isinstance(value, str) else list(value)
        names = [m for m in names if m and m != "none"]  # none always runs
        unknown = sorted(set(names) - set(SPECULATIVE_METHODS) - set(HEAD_METHODS))
        if unknown:
            raise ValueError(
                f"methods {unknown}: choose from none, {', '.join(SPECULATIVE_METHODS)}, {', '.join(HEAD_METHODS)}"
            )
        return tuple(dict.fromkeys(names))

    @field_validator("tree_widths", mode="before")
    @classmethod
    def _parse_tree_widths(cls, value: Any) -> tuple[int, ...]:
        widths = _int_list(value, "tree_widths")
        if not widths or not set(widths) <= {1, 2}:
            raise ValueError(f"tree_widths {value!r}: give 1 (chains), 2 (trees) or 1,2")
        return tuple(sorted(set(widths)))

    @field_validator("weight_formats", mode="before")
    @classmethod
    def _parse_weight_formats(cls, value: Any) -> tuple[str, ...]:
        names = [f.strip() for f in value.split(",")] if isinstance(value, str) else list(value)
        unknown = sorted({f for f in names if f} - set(WEIGHT_FORMATS))
        if unknown:
            raise ValueError(f"weight_formats {unknown}: choose from {', '.join(WEIGHT_FORMATS)}, such as fp32,int4")
        return tuple(dict.fromkeys(["fp32", *(f for f in names if f)]))  # fp32 first: the reference of the others

    @field_validator("k_lists", mode="before")
    @classmethod
    def _parse_k_lists(cls, value: Any) -> tuple[tuple[int, ...], ...]:
        items = value.split(";") if isinstance(value, str) else list(value)
        try:
            lists = [parse_num_speculative_tokens(item.strip() if isinstance(item, str) else item) for item in items]
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if not lists:
            raise ValueError("k_lists is empty; give K lists such as 4;0,4;0,1,2,4,8")
        return tuple(dict.fromkeys(lists))

    @model_validator(mode="after")
    def _check_combination(self) -> BenchOptions:
        k_max = max(k for ks in self.k_lists for k in ks)
        if k_max + 1 > self.ctx_len:
            raise ValueError(f"K {k_max} needs seq_len {k_max + 1} > ctx_len {self.ctx_len}; lower K or raise ctx_len")
        too_long = [n for n in self.prefill_chunk_sizes or () if n > self.longest_prefill_chunk]
        if too_long:
            raise ValueError(
                f"prefill_chunk_sizes {too_long} exceed {self.longest_prefill_chunk} (ctx_len and the smallest "
                "prefill compute-context-length bucket); give smaller sizes"
            )
        if "draft" in self.methods and self.draft_package is None:
            raise ValueError("method draft needs draft_package (compile one with `qspec compile --num-layers N`)")
        if self.draft_package is not None and "draft" not in self.methods:
            raise ValueError(f"draft_package {self.draft_package} is given but methods {list(self.methods)} omit draft")
        if self.tree_widths != (1,) and not self.head_methods:
            raise ValueError(
                f"tree_widths {list(self.tree_widths)} are for head methods; methods {list(self.methods)} name none"
            )
        if self.draft_head is not None and not self.head_methods:
            raise ValueError(
                f"draft_head {self.draft_head} is given but methods {list(self.methods)} name no head method "
                f"({', '.join(HEAD_METHODS)})"
            )
        return self

    @property
    def head_methods(self) -> tuple[str, ...]:
        """The methods that read a draft head (eagle, medusa, and their +pld combinations)."""
        return tuple(m for m in self.methods if m in HEAD_METHODS)

    @property
    def longest_prefill_chunk(self) -> int:
        """The longest prefill chunk the packages take: ctx_len, or the smallest prefill bucket."""
        buckets = _int_list(self.comp_ctx_lengths_prefill or (), "comp_ctx_lengths_prefill")
        return min((self.ctx_len, *buckets))

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The prefill chunk sizes the TTFT sweep runs, each on the packages that take it (see
        ``prefill_chunk_sizes``)."""
        return DEFAULT_PREFILL_CHUNK_SIZES if self.prefill_chunk_sizes is None else self.prefill_chunk_sizes

    @property
    def primary_format(self) -> WeightFormat:
        """The format that runs at every batch size and every K list (fp32, or a given package's own)."""
        return self.weight_formats[0]

    @property
    def all_ks(self) -> tuple[int, ...]:
        """Every K a package must hold: the union of the K lists, plus 0 for ``none``."""
        return tuple(sorted({0, *(k for ks in self.k_lists for k in ks)}))


def quick_options(**overrides: Any) -> BenchOptions:
    """The < 25 minute version on a 2-core machine: 2 prompts per category at batch 1 and all 80 at batch 4, 128
    tokens, fp32 and int4."""
    return BenchOptions.create(**overrides)


def full_options(**overrides: Any) -> BenchOptions:
    """Every prompt, batch sizes 1, 2, 4, 8, fp32, int8 and int4, 50 calls per specialization in the micro-benchmark."""
    preset = {
        "per_category": None,
        "batch_per_category": None,
        "batch_sizes": (1, 2, 4, 8),
        "micro_iterations": 50,
        "weight_formats": WEIGHT_FORMATS,
    }
    return BenchOptions.create(**(preset | overrides))


def head_method(layout: str) -> str:
    """The runtime method of a head layout (its kind's, :data:`qspec.heads.kinds.KINDS`): ``eagle`` for
    EAGLE-1, ``medusa`` for Medusa's and QEfficient's turbo layout."""
    from qspec.heads.kinds import KINDS  # imports torch

    return KINDS[layout].method


def methods_of_head(head_dir: str | Path) -> tuple[str, str]:
    """The head's method and its ``+pld`` combination, from the checkpoint's layout: ``("eagle", "eagle+pld")``."""
    from qspec.heads.modules import detect_layout  # reads the folder's files; imports torch

    method = head_method(detect_layout(head_dir))
    return method, f"{method}+pld"


def bench_options(*, full: bool = False, **given: Any) -> BenchOptions:
    """Options from what a user gave (``qspec bench`` flags) on top of a preset.

    ``None`` means "not given": the preset's value. ``per_category=0`` means every prompt. A
    ``draft_package`` without ``methods`` adds ``draft`` to the default methods; a ``draft_head``
    without ``methods`` adds the head's method and its ``+pld`` combination (:func:`methods_of_head`).
    """
    overrides = {key: value for key, value in given.items() if value is not None}
    for key in ("per_category", "batch_per_category"):
        if overrides.get(key) == 0:
            overrides[key] = None
    if "methods" not in overrides:
        methods = SPECULATIVE_METHODS if "draft_package" in overrides else None
        if "draft_head" in overrides:
            default = (full_options if full else quick_options)().methods
            methods = (*(methods or default), *methods_of_head(overrides["draft_head"]))
        if methods is not None:
            overrides["methods"] = methods
    return (full_options if full else quick_options)(**overrides)
