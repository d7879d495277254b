"""The peers in the same run: ONNX Runtime GenAI and llama.cpp, each behind a :class:`Runner`, when installed.

- **ONNX Runtime GenAI** (``onnxruntime-genai``): its model builder's CPU graph of the same model at
  fp32 and int4 (:mod:`.models`), greedy and with its own n-gram speculation
  (``GeneratorParams.set_speculative_options(ngram_size=3, max_draft_tokens=4)``, the settings its
  guide starts from; batch 1 only in the release), and where the installed version has it (0.18 on) the
  same n-gram at its best: chained lookup, K adapted between 2 and 8, cooldown after misses
  (:data:`ORT_GENAI_ADAPTIVE`, the options its speculative-decoding guide documents).
- **llama.cpp** (``llama-cpp-python``) on the same ``.gguf``: greedy, and with its prompt lookup
  (``LlamaPromptLookupDecoding(num_pred_tokens=4)``).

Both run at batch 1 like the transformers baseline, in worker processes (one per loaded model, so
their threads and memory stay out of the engine's process), on the bench's thread count, and get
the same prompt token ids, token budget and EOS ids as qspec. Whatever cannot run (not installed,
no ``.gguf``, a failed build) is not an error: it is a :class:`Skipped` entry with the reason, in
the report and on stderr; ``pip install 'qspec[peers]'`` installs both.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from qspec.bench.machine import usable_cores
from qspec.bench.options import BenchOptions
from qspec.bench.peers.models import ORT_GENAI_PRECISIONS, PeerUnavailable, build_ort_genai, hf_folder, peers_root
from qspec.bench.peers.workers import ADAPTIVE, GREEDY, LOOKUP
from qspec.bench.plan import RunConfig, Steps
from qspec.bench.report import RunnerInfo, Skipped
from qspec.bench.runners import RequestResult, RoundResult, WorkerRunner
from qspec.bench.workers import BenchError, Worker
from qspec.runtime.metrics import RequestMetrics

ORT_GENAI = "ort-genai"
LLAMA_CPP = "llama.cpp"
PEER_DRAFT_TOKENS = 4  # the peers' draft length: the K of qspec's pld[0,4]
ORT_GENAI_NGRAM = {"ngram_size": 3, "max_draft_tokens": PEER_DRAFT_TOKENS}  # its guide's starting point
ADAPTIVE_DRAFT_TOKENS = 8  # the adaptive n-gram's largest K (its guide's example)
ORT_GENAI_ADAPTIVE = {  # onnxruntime-genai >= 0.18: K adapts between min_adaptive_k and max_draft_tokens
    "ngram_size": 3,
    "max_draft_tokens": ADAPTIVE_DRAFT_TOKENS,
    "ngram_chained_lookup": True,
    "min_adaptive_k": 2,
    "cooldown": True,
}
ORT_GENAI_ADAPTIVE_SINCE = (0, 18)
INSTALL_HINT = "pip install 'qspec[peers]'"
# The module each peer needs; tests point these at modules that do not exist.
PEER_MODULES = {ORT_GENAI: "onnxruntime_genai", LLAMA_CPP: "llama_cpp"}
CONVERTER_MODULES = ("torch", "transformers", "gguf")  # a .gguf -> Hugging Face folder for the builder


def installed(module: str) -> bool:
    """Whether ``module`` can be found (not imported: the peers' native libraries stay out of this process)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def ort_genai_has_adaptive() -> bool:
    """Whether the installed onnxruntime-genai adapts its n-gram's K (read from its version, not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = tuple(int(part) for part in version("onnxruntime-genai").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return release >= ORT_GENAI_ADAPTIVE_SINCE


def peer_request(answer: dict) -> RequestResult:
    """A worker's answer as a :class:`RequestResult` (the peers do not decode text)."""
    metrics = RequestMetrics(arrival=answer["start"], first_token_time=answer["first"], finish_time=answer["finish"])
    metrics.output_tokens = len(answer["tokens"])
    metrics.target_calls = answer["calls"]
    metrics.proposed = answer["proposed"]
    metrics.accepted = answer["accepted"]
    return RequestResult(list(answer["tokens"]), "", metrics)


class PeerRunner(WorkerRunner):
    """One peer model in one worker process; its configurations are variants (greedy, lookup) of it."""

    target: str  # the worker target (qspec.bench.workers.TARGETS)
    what: str  # for messages: "ONNX Runtime GenAI fp32"

    def __init__(
        self, backend: str, variants: dict[str, RunConfig], *, threads: int, eos_token_ids: list[int], ctx_len: int
    ) -> None:
        super().__init__()
        self.backend = backend
        self.variants = {config.key: variant for variant, config in variants.items()}
        self.configs = list(variants.values())
        self.threads = threads
        self.eos_token_ids = eos_token_ids
        self.ctx_len = ctx_len
        self.builds: list = []  # PeerBuild, what prepare made or found

    def prepare(self, steps: Steps) -> list:
        """Make the peer's model files; return the worker's arguments after the common ones."""
        raise NotImplementedError

    def start(self, steps: Steps) -> RunnerInfo:
        """Build what the peer needs, then load it in its worker; PeerUnavailable when it cannot run."""
        args = self.prepare(steps)
        steps.say(f"loading {self.what} (a worker process)")
        worker = Worker(self.target, *args, name=self.what)
        try:
            loaded = worker.receive(f"loading {self.what}")
        except BenchError as exc:
            raise PeerUnavailable(str(exc)) from None
        self.workers[self.backend] = worker
        steps.step(f"{self.what} loaded")
        return RunnerInfo(
            versions=loaded["versions"], load_s=loaded["load_s"], threads=self.threads, builds=self.builds
        )

    def run(self, config: RunConfig, prompts: list[list[int]], max_new_tokens: int) -> RoundResult:
        assert self.workers, f"{type(self).__name__}.run before start"
        answers = self.workers[self.backend].ask(config.key, (self.variants[config.key], prompts, max_new_tokens))
        results = [peer_request(a) for a in answers]
        calls = Counter(prefill=len(answers), forward=sum(a["calls"] for a in answers))
        return RoundResult(results, sum(r.metrics.e2e_s for r in results), calls)


def ort_genai_configs(precision: str, adaptive: bool = False) -> dict[str, RunConfig]:
    """``ort-genai-int4`` (greedy) and ``ort-genai-int4-ngram[4]``, batch 1, on backend ``ort-genai-int4``;
    with ``adaptive`` also ``ort-genai-int4-ngram-adaptive[8]``."""
    backend = f"{ORT_GENAI}-{precision}"
    configs = {
        GREEDY: RunConfig(backend, (), 1, backend, precision),
        LOOKUP: RunConfig(f"{backend}-ngram", (PEER_DRAFT_TOKENS,), 1, backend, precision),
    }
    if adaptive:
        configs[ADAPTIVE] = RunConfig(f"{backend}-ngram-adaptive", (ADAPTIVE_DRAFT_TOKENS,), 1, backend, precision)
    return configs


def llama_cpp_configs(gguf: str) -> dict[str, RunConfig]:
    """``llama.cpp-q4_1`` (greedy) and ``llama.cpp-q4_1-pld[4]``: the GGUF's weight format in the name."""
    stem = Path(gguf).stem
    weights = stem.rsplit(".", 1)[-1].lower() if "." in stem else "gguf"
    method = f"{LLAMA_CPP}-{weights}" if "." in stem else LLAMA_CPP
    return {
        GREEDY: RunConfig(method, (), 1, LLAMA_CPP, weights),
        LOOKUP: RunConfig(f"{method}-pld", (PEER_DRAFT_TOKENS,), 1, LLAMA_CPP, weights),
    }


class OrtGenaiRunner(PeerRunner):
    """ONNX Runtime GenAI on its builder's graph at one precision: greedy and n-gram speculation."""

    target = "ort_genai"

    def __init__(self, source: str, digest: str, precision: str, *, adaptive: bool = False, **kwargs) -> None:
        super().__init__(f"{ORT_GENAI}-{precision}", ort_genai_configs(precision, adaptive), **kwargs)
        self.speculative = {LOOKUP: ORT_GENAI_NGRAM} | ({ADAPTIVE: ORT_GENAI_ADAPTIVE} if adaptive else {})
        self.source, self.digest, self.precision = source, digest, precision
        self.what = f"ONNX Runtime GenAI {precision}"

    def prepare(self, steps: Steps) -> list:
        from importlib.metadata import version

        root = peers_root(self.digest)
        hf = Path(self.source)
        if self.source.endswith(".gguf"):
            try:
                made = hf_folder(self.source, root, steps.say)
            except BenchError as exc:
                raise PeerUnavailable(str(exc)) from None
            self.builds.append(made)
            hf = Path(made.folder)
        build = build_ort_genai(hf, self.precision, root, version("onnxruntime-genai"), steps.say)
        self.builds.append(build)
        return [build.folder, self.threads, self.eos_token_ids, self.ctx_len, self.speculative]


class LlamaCppRunner(PeerRunner):
    """llama.cpp on the same GGUF: greedy and prompt lookup."""

    target = "llama_cpp"
    what = "llama.cpp"

    def __init__(self, gguf: str, **kwargs) -> None:
        super().__init__(LLAMA_CPP, llama_cpp_configs(gguf), **kwargs)
        self.gguf = gguf

    def prepare(self, steps: Steps) -> list:
        return [self.gguf, self.threads, self.eos_token_ids, self.ctx_len, PEER_DRAFT_TOKENS]


@dataclass(frozen=True)
class PeerPlan:
    """The peers that can run and what was skipped, and why; runners are made once EOS ids are known."""

    ort_genai: tuple[str, str] | None  # (source, its digest): the builder's input and the cache key
    gguf: str | None  # llama.cpp's model
    skipped: list[Skipped]
    adaptive: bool = False  # ORT GenAI's n-gram with adaptive K runs too (ort_genai_has_adaptive)

    @property
    def configs(self) -> list[RunConfig]:
        configs = []
        if self.ort_genai:
            configs = [c for p in ORT_GENAI_PRECISIONS for c in ort_genai_configs(p, self.adaptive).values()]
        return configs + (list(llama_cpp_configs(self.gguf).values()) if self.gguf else [])

    def runners(self, options: BenchOptions, eos_token_ids: list[int]) -> list[PeerRunner]:
        common = {
            "threads": options.num_threads or usable_cores(),
            "eos_token_ids": eos_token_ids,
            "ctx_len": options.ctx_len,
        }
        runners: list[PeerRunner] = []
        if self.ort_genai:
            runners += [
                OrtGenaiRunner(*self.ort_genai, p, adaptive=self.adaptive, **common) for p in ORT_GENAI_PRECISIONS
            ]
        if self.gguf:
            runners.append(LlamaCppRunner(self.gguf, **common))
        return runners


def _ort_genai_reason(source: str | None) -> str | None:
    if not installed(PEER_MODULES[ORT_GENAI]):
        return f"onnxruntime-genai is not installed ({INSTALL_HINT})"
    if source is None:
        return "its builder needs the model the package was compiled from, which is not at hand"
    if source.endswith(".gguf"):
        missing = [m for m in CONVERTER_MODULES if not installed(m)]
        if missing:
            needs = ", ".join(missing)
            return (
                f"writing the GGUF as a Hugging Face folder for its builder needs {needs} (pip install 'qspec[export]')"
            )
    return None


def _llama_cpp_reason(source: str | None) -> str | None:
    if not installed(PEER_MODULES[LLAMA_CPP]):
        return f"llama-cpp-python is not installed ({INSTALL_HINT})"
    if source is None or not source.endswith(".gguf"):
        return "llama.cpp runs a .gguf file; the bench was not given one"
    return None


def plan_peers(source: str | None, options: BenchOptions) -> PeerPlan:
    """Which peers can run on ``source`` (the model file or folder); the others as :class:`Skipped`."""
    if not options.peers:
        return PeerPlan(
            None, None, [Skipped(what=f"peers ({ORT_GENAI}, {LLAMA_CPP})", why="not requested (--no-peers)")]
        )
    skipped = []
    ort_genai = gguf = None
    reason = _ort_genai_reason(source)
    if reason is None:
        from qspec.export.loader import resolve_source, source_digest

        ort_genai = (source, source_digest(resolve_source(source)))
    else:
        skipped.append(Skipped(what=f"{ORT_GENAI} (fp32 and int4; greedy and n-gram)", why=reason))
    reason = _llama_cpp_reason(source)
    if reason is None:
        gguf = source
    else:
        skipped.append(Skipped(what=f"{LLAMA_CPP} (greedy and prompt lookup)", why=reason))
    return PeerPlan(ort_genai, gguf, skipped, adaptive=ort_genai is not None and ort_genai_has_adaptive())
