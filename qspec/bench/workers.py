"""Child processes of a bench run: qspec's packages, the memory probes, the transformers baseline, the peers
(:mod:`.peers.workers`).

Each runs in a clean interpreter (a plain subprocess; messages over a socket): every timed runtime, qspec's
engine on one package as much as a peer on its model, runs in a process of its own, so no runtime's memory,
threads or allocator state sit in another's, and a probe's RSS is its configuration's alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qspec.bench.machine import peak_rss_mb, rss_mb
from qspec.bench.plan import HF_LOOKUP_TOKENS
from qspec.errors import QSpecError

if TYPE_CHECKING:
    from qspec.runtime.config import EngineConfig

WORKER_TIMEOUT_S = 3600


class BenchError(QSpecError):
    """A benchmark step failed (a worker process died, a baseline could not load)."""


class Worker:
    """A child interpreter running ``TARGETS[target](conn, *args)``; messages go over a socket.

    A plain subprocess, not ``multiprocessing``: spawn re-imports the caller's main module (a
    script without a ``__main__`` guard would start itself again), fork would inherit ONNX
    Runtime's threads. The child's stdout is discarded and its stderr kept for error messages.
    """

    def __init__(self, target: str, *args: Any, name: str = "the worker process"):
        import socket
        import subprocess
        import sys
        import tempfile
        from multiprocessing.connection import Connection

        parent, child = socket.socketpair()
        self.stderr = tempfile.TemporaryFile()
        code = f"from qspec.bench.workers import worker_main; worker_main({child.fileno()})"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send((target, args))
        self.name = name  # what it runs, for messages: "the transformers worker"

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no message"

    def receive(self, what: str) -> Any:
        if not self.conn.poll(WORKER_TIMEOUT_S):
            self.close()
            raise BenchError(f"{what}: no answer from the worker process in {WORKER_TIMEOUT_S} s")
        try:
            answer = self.conn.recv()
        except EOFError:
            self.close()
            code = self.process.returncode
            raise BenchError(f"{what}: the worker process died (exit code {code}: {self._stderr_tail()})") from None
        if isinstance(answer, dict) and "error" in answer:
            self.close()
            raise BenchError(f"{what}: {answer['error']}")
        return answer

    def ask(self, what: str, message: Any) -> Any:
        self.conn.send(message)
        return self.receive(what)

    def close(self) -> None:
        self.conn.close()
        try:
            self.process.wait(timeout=30)
        except Exception:
            self.process.kill()
            self.process.wait()
        self.stderr.close()


def serve_requests(conn, what: str, load: Callable[[], Any], answer: Callable[[Any], Any]) -> None:
    """A child's life: send what ``load()`` returns, then ``answer(message)`` each message until ``"stop"``, which
    gets the process's RSS and peak; an exception goes to the parent as ``{"error"}`` (``what``: who failed)."""
    try:
        conn.send(load())
        while True:
            message = conn.recv()
            if message == "stop":
                conn.send({"peak_rss_mb": round(peak_rss_mb(), 1), "rss_mb": round(rss_mb(), 1)})
                return
            conn.send(answer(message))
    except Exception as exc:  # sent to the parent, which raises it as a BenchError
        conn.send({"error": f"{what}: {type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def timed_load(load: Callable[[], dict[str, str]]) -> Callable[[], dict[str, Any]]:
    """``load`` (returning the runtime's versions) as a child's first message: ``{"load_s", "versions"}``."""

    def timed() -> dict[str, Any]:
        begin = time.perf_counter()
        versions = load()
        return {"load_s": round(time.perf_counter() - begin, 2), "versions": versions}

    return timed


def worker_main(fd: int) -> None:
    """Entry point of a :class:`Worker` child: receive ``(target name, args)`` and run it."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    target, args = conn.recv()
    assert target in TARGETS, f"unknown worker target {target!r}"
    import importlib

    module, function = TARGETS[target].split(":")
    getattr(importlib.import_module(module), function)(conn, *args)


def probe_main(conn, package: str, config: EngineConfig, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Child: load one configuration's engine, generate ``prompts``, send RSS after load and peak."""
    try:
        from qspec.runtime import Engine, SamplingParams

        start = rss_mb()
        engine = Engine(package, config)
        loaded = rss_mb()
        engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
        conn.send(
            {
                "rss_start_mb": round(start, 1),
                "rss_loaded_mb": round(loaded, 1),
                "rss_after_generate_mb": round(rss_mb(), 1),
                "peak_rss_mb": round(peak_rss_mb(), 1),
                "specializations": len(engine.model.bindings),
            }
        )
    except Exception as exc:  # sent to the parent, which raises it as a BenchError
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def qspec_main(conn, package: str, configs: dict[str, EngineConfig], num_threads: int | None) -> None:
    """Child: load one package and an Engine per configuration on it (``configs``: RunConfig key -> its engine's
    config, :func:`qspec.bench.plan.engine_config`), then answer ``(config key, prompts, batch, max_new_tokens)``
    with ``([(tokens, text, metrics)], wall, calls, seconds)`` (seconds: the engine's timings,
    :class:`~qspec.runtime.metrics.EngineMetrics`).

    At batch 1 each prompt is its own ``generate`` call (TTFT without queueing); at batch B the
    prompts are one ``generate`` call (continuous batching: TTFT includes the wait for a slot).
    """
    engines = {}

    def load() -> dict:
        from qspec.runtime import Engine
        from qspec.runtime.load import load_model

        model = load_model(package, num_threads=num_threads)
        # Engines on one loaded model share its weights, sessions and KV cache, one at a time.
        engines.update({key: Engine(package, config, model=model) for key, config in configs.items()})
        return {"eos_token_ids": sorted(next(iter(engines.values())).eos_token_ids)}

    def answer(message) -> tuple:
        from collections import Counter

        from qspec.runtime import SamplingParams

        key, prompts, batch, max_new_tokens = message
        engine = engines[key]
        params = SamplingParams(max_new_tokens=max_new_tokens)
        results, wall, calls, seconds = [], 0.0, Counter(), Counter()
        for group in [[p] for p in prompts] if batch == 1 else [prompts]:
            outputs = engine.generate(group, params)
            results += [(list(o.token_ids), o.text, o.metrics) for o in outputs]
            wall += engine.last_metrics.wall_s
            calls.update(engine.last_metrics.calls)
            seconds.update(engine.last_metrics.seconds)
        return results, wall, calls, seconds

    serve_requests(conn, f"qspec engine on {package}", load, answer)


def transformers_main(conn, model_ref: str, num_threads: int, eos_token_ids: list[int]) -> None:
    """Child: load the transformers model, then answer ``(lookup, prompts, max_new_tokens)`` requests."""
    loaded: dict[str, Any] = {}

    def load() -> dict[str, Any]:
        import torch
        import transformers

        from qspec.export.loader import load_model, resolve_source

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(num_threads)
        begin = time.perf_counter()
        model, _ = load_model(resolve_source(model_ref))
        forwards = loaded["forwards"] = [0]
        model.register_forward_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))
        loaded["model"] = model
        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        return {"load_s": round(time.perf_counter() - begin, 2), "versions": versions}

    def answer(message) -> list[dict]:
        lookup, prompts, max_new_tokens = message
        return [
            _hf_generate(loaded["model"], loaded["forwards"], ids, lookup, max_new_tokens, eos_token_ids)
            for ids in prompts
        ]

    serve_requests(conn, "transformers baseline", load, answer)


def _hf_generate(model, forwards: list[int], ids: list[int], lookup: bool, max_new_tokens: int, eos: list[int]) -> dict:
    """One greedy ``generate`` (``lookup``: with transformers' prompt lookup), timed to its first token."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """Notes when the first generated token arrives (the first ``put`` is the prompt)."""

        def __init__(self) -> None:
            self.puts, self.time = 0, 0.0

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.time = time.perf_counter()

        def end(self) -> None:
            pass

    extra = {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS} if lookup else {}
    streamer = FirstToken()
    forwards[0] = 0
    input_ids = torch.tensor([ids], dtype=torch.long)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0],
            streamer=streamer,
            **extra,
        )
    finish = time.perf_counter()
    tokens = out[0, len(ids) :].tolist()
    first = streamer.time or finish
    return {"tokens": tokens, "start": start, "first": first, "finish": finish, "forwards": forwards[0]}


# Worker targets as "module:function", imported in the child only: the peers' workers (which start
# Workers of their own) are not imported by this module.
TARGETS = {
    "qspec": "qspec.bench.workers:qspec_main",
    "probe": "qspec.bench.workers:probe_main",
    "transformers": "qspec.bench.workers:transformers_main",
    "ort_genai": "qspec.bench.peers.workers:ort_genai_main",
    "llama_cpp": "qspec.bench.peers.workers:llama_cpp_main",
    "peer_hf_folder": "qspec.bench.peers.workers:hf_folder_main",
}
