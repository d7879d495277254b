"""The runtimes a bench run measures, behind one small interface: :class:`Runner`.

The run loop knows only ``Runner``: it gives every configuration the same prompt token ids and gets
back, per request, the token ids and :class:`RequestMetrics`. qspec's own engine is one runner
(:class:`QspecRunner`, a worker process per package); the transformers baseline another
(:class:`TransformersRunner`, in a worker process). A peer runtime (ONNX Runtime GenAI, llama.cpp,
...) plugs in the same way: subclass ``Runner``, declare its configurations (``RunConfig(...,
backend=its name)``, batch 1 like the transformers baseline, or more), and add it in
:func:`qspec.bench.run.baseline_runners`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qspec.bench.machine import usable_cores
from qspec.bench.plan import HF_LOOKUP, TRANSFORMERS, RunConfig, Steps, engine_config, transformers_configs
from qspec.bench.report import RunnerInfo
from qspec.bench.workers import Worker
from qspec.runtime.metrics import RequestMetrics


@dataclass(frozen=True)
class RequestResult:
    """One request of a round: its generated token ids, text ("" when the runtime does not decode) and metrics."""

    tokens: list[int]
    text: str
    metrics: RequestMetrics


@dataclass(frozen=True)
class RoundResult:
    """One configuration on one round: a result per prompt (in order), the wall time, calls per kind and
    (a qspec engine) where its wall time went."""

    requests: list[RequestResult]
    wall_s: float
    calls: Counter = field(default_factory=Counter)  # "prefill" and one entry per K (a baseline: "forward")
    seconds: Counter = field(default_factory=Counter)  # EngineMetrics.seconds; empty for a baseline


class Runner(ABC):
    """A runtime that runs some of the bench's configurations on token ids, greedy.

    Lifecycle: ``start`` once (load; may take long), ``run`` once per configuration and round,
    ``stop`` once at the end (its process's peak RSS), ``close`` always (also after an error).
    """

    backend: str  # "qspec", "transformers", or a peer's name; RunConfig.backend of its configurations
    configs: list[RunConfig]

    def start(self, steps: Steps) -> RunnerInfo | None:
        """Load the runtime; what it says about itself (versions, load time) for the report."""
        return None

    @abstractmethod
    def run(self, config: RunConfig, prompts: list[list[int]], max_new_tokens: int) -> RoundResult:
        """Generate ``max_new_tokens`` greedy tokens for each prompt (token ids) with ``config``."""

    def stop(self) -> float | None:
        """Peak RSS (MB) of the runtime's own process; None when it shares the bench's process."""
        return None

    def close(self) -> None:
        """Release what ``start`` took; safe to call twice."""


class WorkerRunner(Runner):
    """A runner whose runtime lives in worker processes (:class:`~qspec.bench.workers.Worker`): one ``stop`` (each
    worker's peak RSS) and one ``close`` for all of them."""

    reports_peak_rss = True  # False: each configuration's peak RSS is its memory probe's, not its worker's

    def __init__(self) -> None:
        self.workers: dict[Any, Worker] = {}

    def stop(self) -> float | None:
        """Stop the workers; the largest peak RSS among them (None when ``reports_peak_rss`` is off)."""
        try:
            peaks = [worker.ask(f"stopping {worker.name}", "stop")["peak_rss_mb"] for worker in self.workers.values()]
        finally:
            self.close()
        return max(peaks) if peaks and self.reports_peak_rss else None

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers = {}


class QspecRunner(WorkerRunner):
    """qspec's engine: one worker process per package (weight format x batch size), as each peer model has
    its own, with an Engine per configuration on the package's one loaded model (:func:`.workers.qspec_main`).

    The parent keeps only the package's tokenizer (the chat template for every configuration's prompts).
    """

    backend = "qspec"
    reports_peak_rss = False

    def __init__(
        self,
        packages: dict[tuple[str, int], Path],  # (weight format, max batch size) -> package
        configs: list[RunConfig],
        *,
        num_threads: int | None,
        dispatch: str,
        draft_package: Path | None,
    ) -> None:
        super().__init__()  # workers: (weight format, batch) -> its package's process
        self.packages = packages
        self.configs = configs
        self.num_threads = num_threads
        self.dispatch = dispatch
        self.draft_package = draft_package
        self.eos_token_ids: list[int] = []
        self.tokenizer: Any = None

    def start(self, steps: Steps) -> RunnerInfo | None:
        from qspec.package import TOKENIZER_DIR
        from qspec.runtime.tokenizer import Tokenizer

        for (weight_format, batch), package in self.packages.items():
            steps.say(f"loading the {weight_format} batch {batch} package (a worker process)")
            mine = {
                c.key: engine_config(
                    c, dispatch=self.dispatch, num_threads=self.num_threads, draft_package=self.draft_package
                )
                for c in self.configs
                if (c.weight_format, c.batch) == (weight_format, batch)
            }
            name = f"the {weight_format} batch {batch} package"
            worker = self.workers[weight_format, batch] = Worker(
                "qspec", str(package), mine, self.num_threads, name=name
            )
            self.eos_token_ids = worker.receive(f"loading the {weight_format} batch {batch} package")["eos_token_ids"]
            steps.step(f"{weight_format} batch {batch} engines ready")
        self.tokenizer = Tokenizer(next(iter(self.packages.values())) / TOKENIZER_DIR)
        return None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (the package's template), the same for every configuration."""
        return self.tokenizer.encode_prompt(messages, chat=True)

    def run(self, config: RunConfig, prompts: list[list[int]], max_new_tokens: int) -> RoundResult:
        worker = self.workers[config.weight_format, config.batch]
        answers, wall, calls, seconds = worker.ask(config.key, (config.key, prompts, config.batch, max_new_tokens))
        return RoundResult([RequestResult(*answer) for answer in answers], wall, calls, seconds)


def _transformers_request(result: dict) -> RequestMetrics:
    """A transformers generation as RequestMetrics: decode calls = forwards after the prefill."""
    tokens = len(result["tokens"])
    calls = max(result["forwards"] - 1, 0)
    metrics = RequestMetrics(arrival=result["start"], first_token_time=result["first"], finish_time=result["finish"])
    metrics.output_tokens = tokens
    metrics.target_calls = calls
    metrics.accepted = max(tokens - 1 - calls, 0)  # tokens beyond one per call came from lookup
    return metrics


class TransformersRunner(WorkerRunner):
    """``generate(do_sample=False)`` and ``generate(prompt_lookup_num_tokens=4)`` at batch 1, in a worker process."""

    backend = TRANSFORMERS

    def __init__(self, source: str, *, num_threads: int | None, eos_token_ids: list[int]) -> None:
        super().__init__()
        self.source = source
        self.threads = num_threads or usable_cores()
        self.eos_token_ids = eos_token_ids
        self.configs = transformers_configs()

    def start(self, steps: Steps) -> RunnerInfo:
        steps.say("loading the transformers model (a worker process)")
        worker = Worker("transformers", self.source, self.threads, self.eos_token_ids, name="the transformers worker")
        self.workers[TRANSFORMERS] = worker
        loaded = worker.receive("loading the transformers model")
        steps.step("transformers model loaded")
        return RunnerInfo(versions=loaded["versions"], load_s=loaded["load_s"], threads=self.threads)

    def run(self, config: RunConfig, prompts: list[list[int]], max_new_tokens: int) -> RoundResult:
        assert self.workers, "TransformersRunner.run before start"
        answers = self.workers[TRANSFORMERS].ask(config.key, (config.method == HF_LOOKUP, prompts, max_new_tokens))
        results = [RequestResult(a["tokens"], "", _transformers_request(a)) for a in answers]
        wall = sum(r.metrics.e2e_s for r in results)
        calls = Counter(prefill=len(answers), forward=sum(a["forwards"] for a in answers))
        return RoundResult(results, wall, calls)
