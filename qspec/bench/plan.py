"""What a run measures and in which order: the configurations, and the interleaved rounds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qspec.bench.options import BenchOptions

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
    """

    method: str  # none, pld, suffix, draft; a baseline's own name (transformers, transformers-pld)
    ks: tuple[int, ...]
    batch: int
    backend: str = QSPEC

    @property
    def name(self) -> str:
        """``none``, ``pld[0,4]``, ``transformers``, ``transformers-pld[4]``: the line in the plot."""
        if self.method == "none" or not self.ks:
            return self.method
        return f"{self.method}[{','.join(map(str, self.ks))}]"

    @property
    def key(self) -> str:
        """``pld[0,4]@1``: name and max batch size."""
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


def plan_configs(options: BenchOptions, *, draft_slots: int | None = None) -> list[RunConfig]:
    """Every configuration of the run: per batch size ``none`` and method x K list; then the baselines.

    ``draft_slots``: KV slots of the draft package; ``draft`` runs only at batch sizes it can hold.
    """
    configs = []
    for batch in options.batch_sizes:
        configs.append(RunConfig("none", (0,), batch))
        methods = [m for m in options.methods if m != "draft" or draft_slots is None or batch <= draft_slots]
        configs += [RunConfig(m, ks, batch) for m in methods for ks in options.k_lists]
    if options.baselines:
        configs += transformers_configs()
    return configs


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
