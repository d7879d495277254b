"""The bench report as typed values, from where each part is made (analysis, micro, memory) to the renderers.

:class:`BenchReport` is what :func:`qspec.bench.run_bench` returns and ``report.json`` holds
(``model_dump_json``); :mod:`qspec.bench.render` and the CLI read its fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from qspec.bench.options import BenchOptions
from qspec.runtime.metrics import EngineMetrics, StepTimes, step_times

if TYPE_CHECKING:
    from qspec.bench.plan import RunConfig


class ReportModel(BaseModel):
    """Base of the report's parts: frozen, unknown keys refused (a typo is an error, not a new key)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Overall(ReportModel):
    """A configuration's totals over every round: :class:`EngineMetrics` plus what the report adds."""

    requests: int
    wall_s: float
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms_median: float
    ttft_ms_mean: float
    tpot_ms_median: float
    tpot_ms_mean: float
    mean_accepted_tokens: float
    acceptance_rate: float | None  # None: the runtime does not say how many tokens it proposed
    proposed: int
    accepted: int
    sequence_calls: int
    calls: dict[str, int]  # "prefill" and one entry per K (a baseline: "forward")
    # Per draft position (qspec.runtime.metrics); empty where the runtime does not say (a baseline)
    reached_per_position: list[int] = []
    accepted_per_position: list[int] = []
    acceptance_per_position: list[float | None] = []
    ratio_to_none: float | None = None  # requests/s against none at the same batch size
    peak_rss_mb: float | None = None
    seconds: dict[str, float] = {}  # where a qspec engine's wall time went (EngineMetrics.seconds)

    @property
    def step(self) -> StepTimes | None:
        """Where a decode step's time went: the target's call, drafting, the host's rest (None for a baseline)."""
        return step_times(self.wall_s, self.calls, self.seconds)

    @property
    def tokens_per_drafted_call(self) -> float | None:
        """Mean acceptance length over the calls that verified at least one draft: accepted drafts / those
        calls + 1 (None without per-position counts)."""
        drafted = self.reached_per_position[0] if self.reached_per_position else 0
        return round(self.accepted / drafted + 1, 4) if drafted else None

    @classmethod
    def from_metrics(cls, metrics: EngineMetrics, *, proposals_known: bool = True) -> Overall:
        values = metrics.to_dict()
        if not proposals_known:
            values["acceptance_rate"] = None
        return cls(**values)


class CategoryRow(ReportModel):
    """One category of one configuration: requests, tokens, Σ latency and the rates over it."""

    requests: int
    output_tokens: int
    latency_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ratio_to_none: float | None = None


class ConfigSummary(ReportModel):
    """One configuration's results: overall, per category, and each round's wall time and contention."""

    key: str  # pld[0,4]@1
    name: str  # pld[0,4]
    method: str
    ks: list[int]
    batch: int
    backend: str  # qspec, transformers, or a peer runtime
    overall: Overall
    per_category: dict[str, CategoryRow]
    round_walls_s: list[float]
    round_other_cpu: list[float]  # other processes' CPU share during each round
    weight_format: str | None = None  # the weights it ran: fp32, int8, int4 (llama.cpp: the GGUF type, q4_1)
    tree_width: int = 1  # a head's drafts at depth 1 (RunConfig.tree_width)

    @classmethod
    def for_config(cls, config: RunConfig, **results: Any) -> ConfigSummary:
        """The summary of ``config``: what it is from the config, what it measured from ``results``."""
        identity = dict(key=config.key, name=config.name, method=config.method, ks=list(config.ks))
        identity |= dict(batch=config.batch, backend=config.backend, weight_format=config.weight_format)
        identity |= dict(tree_width=config.tree_width)
        return cls(**identity, **results)


class MicroCall(ReportModel):
    specialization: str  # prefill, K=0, K=4
    shape: str
    median_ms: float
    tokens_per_call: int
    ratio_to_floor: float


class MicroPackage(ReportModel):
    """One call per specialization of a package, against ``weight bytes / copy bandwidth`` of its own weights."""

    batch: int
    weight_format: str = "fp32"
    # "runtime": the package's ONNX Runtime graph; "vendor": model.onnx, explicit attention over the
    # compute-context-length slots, as the qaic backend compiles it (timed for the bucket target)
    graph: str = "runtime"
    package: str
    weight_bytes: int
    floor_ms: float
    iterations: int
    calls: list[MicroCall]


class MicroHead(ReportModel):
    """One call per specialization of a package's draft head (EAGLE: prefill, the one-token chain step and
    each catch-up width; Medusa: each batch size), beside the target's cheapest decode call of that package."""

    batch: int  # the package's max batch size
    weight_format: str
    method: str  # eagle, medusa
    package: str
    weight_bytes: int  # the head's runtime graph
    floor_ms: float
    iterations: int
    target_k0_ms: float | None  # the package's K=0 call (smallest bucket) in the same micro-benchmark
    calls: list[MicroCall]


class PrefillChunk(ReportModel):
    """Time to first token with prompts prefilled in chunks of ``prefill_seq_len`` tokens (batch 1)."""

    weight_format: str
    prefill_seq_len: int
    ttft_median_ms: float
    prefill_calls_per_prompt: float  # prefill chunks plus decode-shape tails (qspec.runtime.prefill)
    package_default: bool  # the package's own prefill_seq_len


class MicroReport(ReportModel):
    copy_bandwidth_gb_s: float
    packages: list[MicroPackage]
    prefill: list[PrefillChunk] = []
    prefill_prompts: int = 0  # prompts per chunk size and round
    prefill_rounds: int = 0
    heads: list[MicroHead] = []  # packages with a draft head


class MemoryProbe(ReportModel):
    """One configuration loaded and run in its own process."""

    rss_start_mb: float
    rss_loaded_mb: float
    rss_after_generate_mb: float
    peak_rss_mb: float
    specializations: int


class CeilingRow(ReportModel):
    """A speculative configuration against an oracle that dispatches its own drafts knowing how many will be
    accepted, at its batch size's prices (:mod:`qspec.bench.ceiling`)."""

    key: str  # pld[0,1,2,4,8]-int4@1
    weight_format: str
    ks: list[int]
    positions: int  # decode positions replayed (none's output tokens after the first)
    drafted_positions: int  # of which the proposer offered drafts at
    oracle_calls: int
    oracle_x_none: float  # the ceiling: none's decode time over the oracle's, at micro-benchmark prices
    measured_x_none: float  # none's decode ms per token over the configuration's (the same requests)
    captured: float | None  # (measured - 1) / (ceiling - 1): the share of the possible gain taken
    # "tokens": a lookup proposer replayed on tokens; "hidden states": a draft head replayed on the target's
    # hidden states along none's output, its calls priced by the micro-benchmark (qspec.bench.ceiling)
    replay: Literal["tokens", "hidden states"] = "tokens"


class MemoryReport(ReportModel):
    """Every probe, and the peak RSS of the most specializations against the K=0-only package."""

    probe_prompts_max_new_tokens: int
    probes: dict[str, MemoryProbe]
    one_peak_mb: float | None = None
    many_peak_mb: float | None = None
    many_config: str | None = None
    many_label: str | None = None
    ratio: float | None = None
    none_ratio: float | None = None  # none on both packages: only the package differs


class Mismatch(ReportModel):
    request: str
    first_difference_at: int
    lengths: list[int]  # [mine, reference]


class OutputComparison(ReportModel):
    """How many requests' tokens equal the reference's, and where the others diverge."""

    equal: int
    total: int
    mismatches: list[Mismatch]
    # Mean over requests of (common prefix length / the longer output's length); 1.0 when all are equal.
    mean_common_prefix: float = 1.0


class EqualityCheck(OutputComparison):
    config: str
    reference: str
    # speculative: against none of the same format and batch (must be equal); batch: none@B against
    # none@1; format: a quantized none against fp32 none (agreement, not a gate); baseline: against qspec
    # none of its weight format if qspec ran it, else none@1.
    kind: Literal["batch", "baseline", "speculative", "format"]


class Equality(ReportModel):
    speculative_equal_none: bool  # the headline: every speculative configuration reproduced none
    all_equal: bool
    checks: list[EqualityCheck]


class MachineInfo(ReportModel):
    cpu: str
    cores: int
    memory_gb: float
    python: str
    onnxruntime: str
    numpy: str
    qspec: str
    other_processes_cpu_share: float


class PeerBuild(ReportModel):
    """A model file set a peer runs (a builder's graph, a converted folder): how it was made, how long it took."""

    what: str  # "ort-genai int4", "hf folder"
    folder: str
    build_s: float  # the wall time when it was built (a cached build keeps its own)
    cached: bool  # True: reused from an earlier run
    size_mb: float
    command: str


class Skipped(ReportModel):
    """A part of the run that did not run, and why (a peer not installed, no .gguf, a failed build)."""

    what: str
    why: str


class RunnerInfo(ReportModel):
    """What a runtime outside qspec's engine (transformers, a peer) says about itself when loaded."""

    versions: dict[str, str]
    load_s: float | None = None
    threads: int | None = None
    builds: list[PeerBuild] = []  # what a peer built (or found cached) before loading


class Meta(ReportModel):
    model: str
    packages: dict[str, str]  # batch size (primary weight format) or "int4@1" -> package folder
    started: str
    wall_s: float
    phases: dict[str, float]  # compile_s, load_s, ...
    options: BenchOptions
    prompts: int
    categories: list[str]
    batch_prompts: int | None = None  # first turns at batch > 1 (more than ``prompts``: fewer runs drain)
    machine: MachineInfo
    runners: dict[str, RunnerInfo]  # backend name -> info, for every backend but qspec
    notes: list[str]
    skipped: list[Skipped] = []


class BenchReport(ReportModel):
    meta: Meta
    configs: list[ConfigSummary]
    micro: MicroReport | None
    memory: MemoryReport | None
    equality: Equality
    outputs: dict[str, dict[str, list[int]]]  # config key -> request id -> token ids
    ceilings: list[CeilingRow] = []

    def config(self, key: str) -> ConfigSummary | None:
        """The summary of configuration ``key`` (``none@1``), None when it did not run."""
        return next((s for s in self.configs if s.key == key), None)
