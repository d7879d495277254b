"""What a run measures and in which order: the configurations, and the interleaved rounds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from qspec.bench.options import BenchOptions
from qspec.runtime.config import EngineConfig

QSPEC = "qspec"  # the backend of qspec's own configurations; every other backend is a baseline
TRANSFORMERS = "transformers"
HF_GREEDY = "transformers"
HF_LOOKUP = "transformers-pld"
HF_LOOKUP_TOKENS = 4  # prompt_lookup_num_tokens of the transformers baseline


@dataclass(frozen=True)
class RunConfig:
    """One measured configuration: a method with its K list at a max batch size, on one backend.

    ``backend`` is ``qspec`` for the engine's configurations; a baseline (transformers, a peer
    runtime) names its own and runs through its own :class:`~qspec.bench.runners.Runner`.
    ``weight_format``: the weights it runs, a qspec package's format (fp32, int8, int4); a baseline's
    own (ONNX Runtime GenAI's fp32 or int4, llama.cpp's GGUF type such as ``q4_1``), which its name
    already says, so it only picks the qspec ``none`` a baseline is compared with.
    """

    method: str  # none, pld, suffix, draft; a baseline's own name (transformers, transformers-pld)
    ks: tuple[int, ...]
    batch: int
    backend: str = QSPEC
    weight_format: str = "fp32"
    tree_width: int = 1  # a head's drafts at depth 1 (2: its runner-up beside the chain, EngineConfig.tree_width)

    @property
    def name(self) -> str:
        """``none``, ``pld[0,4]``, ``pld[0,4]-int4``, ``eagle-tree2[0,4]``, ``transformers-pld[4]``: the line in the
        plot.

        fp32 keeps the bare name (the reports before weight formats); another format is a suffix,
        as in the peers' ``ort-genai-int4``.
        """
        method = self.method if self.tree_width == 1 else f"{self.method}-tree{self.tree_width}"
        name = method if self.method == "none" or not self.ks else f"{method}[{','.join(map(str, self.ks))}]"
        return name if self.baseline or self.weight_format == "fp32" else f"{name}-{self.weight_format}"

    @property
    def key(self) -> str:
        """``pld[0,4]@1``, ``none-int4@1``: name and max batch size."""
        return f"{self.name}@{self.batch}"

    @property
    def baseline(self) -> bool:
        return self.backend != QSPEC

    @property
    def variable(self) -> bool:
        return len(self.ks) > 1


def transformers_configs() -> list[RunConfig]:
    """The transformers baselines: greedy and prompt lookup, batch 1."""
    return [
        RunConfig(HF_GREEDY, (), 1, TRANSFORMERS),
        RunConfig(HF_LOOKUP, (HF_LOOKUP_TOKENS,), 1, TRANSFORMERS),
    ]


def none_config(weight_format: str, batch: int) -> RunConfig:
    """qspec ``none`` of one weight format at one max batch size: the reference of its speculative configurations."""
    return RunConfig("none", (0,), batch, QSPEC, weight_format)


def plan_configs(options: BenchOptions, *, draft_slots: int | None = None) -> list[RunConfig]:
    """Every configuration of the run: the primary format's, the other formats', then the baselines.

    The primary format (fp32) runs ``none`` and method x K list at every batch size. Every other
    weight format runs ``none`` and each method with the variable K lists only, at batch 1 only:
    what the issue compares against the peers (batch 1, greedy and speculation) with a quick run
    kept under ~25 minutes on 2 cores (each format adds a compile, a micro-benchmark and its
    rounds). ``draft_slots``: KV slots of the draft package; ``draft`` runs only at batch sizes it can hold.
    A tree width above 1 adds each head method at that width, at batch 1 only (trees are verified on a
    one-slot package; with several rows in flight the engine verifies the chain).
    """
    configs = []
    primary, *others = options.weight_formats
    for batch in options.batch_sizes:
        configs.append(none_config(primary, batch))
        methods = [m for m in options.methods if m != "draft" or draft_slots is None or batch <= draft_slots]
        for m in methods:
            configs += [
                RunConfig(m, ks, batch, QSPEC, primary, w) for w in _widths(options, m, batch) for ks in options.k_lists
            ]
    variable = [ks for ks in options.k_lists if len(ks) > 1]
    for weight_format in others:
        configs.append(none_config(weight_format, 1))
        for m in options.methods:
            configs += [RunConfig(m, ks, 1, QSPEC, weight_format, w) for w in _widths(options, m, 1) for ks in variable]
    if options.baselines:
        configs += transformers_configs()
    return configs


def _widths(options: BenchOptions, method: str, batch: int) -> tuple[int, ...]:
    """The tree widths ``method`` runs at ``batch``: every given width for a head method at batch 1, else 1."""
    return options.tree_widths if batch == 1 and method in options.head_methods else (1,)


def beside_baselines(configs: Sequence[RunConfig]) -> list[RunConfig]:
    """Batch-1 ``configs`` in the order a prompt runs them: each baseline among the qspec configurations it is
    compared with, so that the per-prompt rotation (:func:`rotated`) keeps them seconds apart.

    Per qspec weight format, in the order given: its ``none``, the greedy baselines of that format (ONNX Runtime
    GenAI's greedy beside qspec's ``none``), the first half of its speculative configurations, the speculative
    baselines of that format (a peer's n-gram), the second half. Baselines of a format qspec does not run
    (llama.cpp's GGUF type) come last. Example: ``none``, ``transformers``, ``ort-genai-fp32``, ``pld[0,4]``,
    ``transformers-pld[4]``, ``ort-genai-fp32-ngram[4]``, ``eagle[0,4]``, ``none-int4``, ``ort-genai-int4``, ...
    """
    ours = [c for c in configs if not c.baseline]
    theirs = [c for c in configs if c.baseline]
    order: list[RunConfig] = []
    for weight_format in dict.fromkeys(c.weight_format for c in ours):
        own = [c for c in ours if c.weight_format == weight_format]
        nones = [c for c in own if c.method == "none"]
        speculative = [c for c in own if c.method != "none"]
        greedy = [c for c in theirs if c.weight_format == weight_format and not c.ks]
        drafting = [c for c in theirs if c.weight_format == weight_format and c.ks]
        half = (len(speculative) + 1) // 2
        order += [*nones, *greedy, *speculative[:half], *drafting, *speculative[half:]]
    return order + [c for c in theirs if c not in order]


def rotated(items: Sequence, by: int) -> list:
    """``items`` rotated left by ``by``: ``rotated([a, b, c], 1) == [b, c, a]``."""
    if not items:
        return []
    by %= len(items)
    return [*items[by:], *items[:by]]


def rounds(count: int, size: int) -> list[range]:
    """Indices ``0..count-1`` in consecutive rounds of ``size``: ``rounds(5, 2) == [0:2, 2:4, 4:5]``."""
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


Progress = Callable[[str, int, int], None]  # (message, units done, units in total)


class Steps:
    """Progress in units of work: ``say`` what starts, ``step`` when a unit is done."""

    def __init__(self, progress: Progress | None, total: int = 1) -> None:
        self._progress = progress or (lambda message, done, total: None)
        self.done = 0
        self.total = total

    def say(self, message: str) -> None:
        self._progress(message, self.done, self.total)

    def step(self, message: str) -> None:
        self.done += 1
        self._progress(message, self.done, self.total)


def engine_config(
    config: RunConfig, *, num_threads: int | None, draft_package: Path | None, dispatch: str = "auto"
) -> EngineConfig:
    """The engine a qspec configuration runs (its method on its Ks), as its worker and its memory probe build it:
    the draft package only for ``draft``."""
    return EngineConfig.create(
        method=config.method,
        num_speculative_tokens=config.ks,
        dispatch=dispatch,
        num_threads=num_threads,
        draft_package=draft_package if config.method == "draft" else None,
        tree_width=config.tree_width if config.tree_width > 1 else None,
    )
