"""A bounded load run against ``qspec serve`` on loopback: concurrent streaming clients, Poisson arrivals.

For each method, a ``qspec serve`` process is started on a free loopback port; ``requests`` chat requests
(MT-bench first turns, greedy) arrive as a Poisson process of ``rate`` per second, at most
``concurrency`` in flight, each streamed. Reported as vLLM's ``benchmark_serving`` does: requests/s,
output tokens/s, TTFT (send to first content chunk), ITL (gaps between content chunks; a chunk may hold
several tokens), TPOT ((latency - TTFT) / (tokens - 1)). Then every response is checked against the
engine's own greedy output for the same prompt (:func:`reference_texts`): no request lost or garbled.
The run is bounded: a fixed number of requests, a time limit, loopback only, the server stopped after.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from qspec.common import FrozenModel
from qspec.errors import ConfigError
from qspec.serve.server import free_port

SERVED_NAME = "load"


class LoadOptions(FrozenModel):
    requests: int = Field(default=64, ge=1, le=1000)
    concurrency: int = Field(default=32, ge=1, le=256)
    rate: float = Field(default=4.0, gt=0)  # Poisson arrivals per second
    max_tokens: int = Field(default=128, ge=1)
    seed: int = 0
    time_limit_s: float = Field(default=600.0, gt=0)  # per method
    spinning: bool = True  # ONNX Runtime's spinning threads (off: better on a machine shared with other jobs)
    prefix_cache: bool = True  # the servers reuse prefixes (off: qspec serve --no-prefix-cache)


class RequestRecord(BaseModel):
    index: int
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = Field(default_factory=list)
    error: str | None = None


class LoadReport(BaseModel):
    method: str
    requests: int
    completed: int
    failed: int
    mismatched: list[int] = Field(default_factory=list)  # request indexes whose text differs from the reference
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    tpot_ms_p50: float
    acceptance_rate: float | None = None  # from the server's /metrics
    mean_acceptance_length: float | None = None
    prefix_cache_hit_rate: float | None = None  # prompt tokens found in the prefix cache / looked up
    decode_calls: dict[str, float] = Field(default_factory=dict)


def mt_bench_prompts(n: int) -> list[str]:
    """First turns of MT-bench, categories interleaved (writing, roleplay, ..., writing, ...), the first ``n``."""
    from qspec.prompts import SHIPPED_MT_BENCH, load_prompts

    seen: dict[str, int] = {}
    ranked = []
    for record in load_prompts(SHIPPED_MT_BENCH):
        rank = seen.get(record.category, 0)
        seen[record.category] = rank + 1
        ranked.append((rank, len(ranked), record.turns[0]))
    return [text for _, _, text in sorted(ranked)][:n]


def _percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else 0.0


# --------------------------------------------------------------------------------------------
# The clients
# --------------------------------------------------------------------------------------------


async def _one(client, url: str, index: int, prompt: str, max_tokens: int) -> RequestRecord:
    record = RequestRecord(index=index)
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    parts = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return record
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    text = choice["delta"].get("content")
                    if text:
                        now = time.perf_counter()
                        if parts:
                            record.itl_s.append(now - last)
                        else:
                            record.ttft_s = now - start
                        last = now
                        parts.append(text)
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
    except Exception as exc:  # a lost request is reported, not raised
        record.error = f"{type(exc).__name__}: {exc}"
    record.text = "".join(parts)
    record.latency_s = time.perf_counter() - start
    if record.finish_reason is None and record.error is None:
        record.error = "the stream ended without a finish reason"
    return record


async def run_clients(url: str, prompts: list[str], options: LoadOptions) -> tuple[list[RequestRecord], float]:
    """Send every prompt at Poisson arrival times, at most ``concurrency`` in flight; (records, wall seconds)."""
    import httpx

    rng = np.random.default_rng(options.seed)
    arrivals = np.cumsum(rng.exponential(1 / options.rate, size=len(prompts)))
    gate = asyncio.Semaphore(options.concurrency)
    limits = httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(options.time_limit_s), limits=limits) as client:
        start = time.perf_counter()

        async def arrive(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with gate:
                return await _one(client, url, i, prompts[i], options.max_tokens)

        records = await asyncio.wait_for(
            asyncio.gather(*(arrive(i) for i in range(len(prompts)))), options.time_limit_s
        )
        return list(records), time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# A server per method, the reference, the report
# --------------------------------------------------------------------------------------------


def _start_server(
    package: Path, method: str, port: int, *, max_waiting: int, spinning: bool, prefix_cache: bool = True
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "qspec", "serve", str(package), "--port", str(port), "--method", method,
           "--served-model-name", SERVED_NAME, "--max-waiting", str(max_waiting), "--log-level", "warning",
           "--spinning" if spinning else "--no-spinning"]  # fmt: skip
    cmd.append("--prefix-cache" if prefix_cache else "--no-prefix-cache")
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"qspec serve exited with {proc.returncode}: {proc.stderr.read().decode()[-500:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise ConfigError(f"qspec serve did not answer /health within {timeout} s")


def _scrape(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            key = s.name + "".join(f"[{v}]" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[key] = s.value
    return samples


def run_method(
    package: Path, method: str, prompts: list[str], options: LoadOptions
) -> tuple[list[RequestRecord], float, dict]:
    """Start a server with ``method``, run the clients, scrape /metrics, stop the server (SIGTERM)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start_server(
        package, method, port, max_waiting=len(prompts), spinning=options.spinning, prefix_cache=options.prefix_cache
    )
    try:
        _wait_healthy(proc, url)
        records, wall = asyncio.run(run_clients(url, prompts, options))
        return records, wall, _scrape(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def reference_texts(package: Path, prompts: list[str], max_tokens: int, *, spinning: bool = True) -> list[str]:
    """The engine's greedy output for each prompt: plain decoding in one ``generate`` call, admitted in order.

    (Greedy output does not depend on the batch: tests/test_smollm2.py checks it on this model.)
    """
    from qspec.runtime import Engine, SamplingParams

    engine = Engine(package, method="none", spinning=spinning)
    return [o.text for o in engine.generate(prompts, SamplingParams(max_new_tokens=max_tokens), chat=True)]


def summarize(
    method: str, records: list[RequestRecord], wall: float, metrics: dict, reference: list[str] | None
) -> LoadReport:
    ok = [r for r in records if r.error is None]
    itl = [gap for r in ok for gap in r.itl_s]
    tpot = [(r.latency_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    drafts = metrics.get("qspec:spec_decode_num_drafts_total", 0)
    draft_tokens = metrics.get("qspec:spec_decode_num_draft_tokens_total", 0)
    accepted = metrics.get("qspec:spec_decode_num_accepted_tokens_total", 0)
    queries = metrics.get("qspec:prefix_cache_queries_total", 0)
    return LoadReport(
        method=method,
        requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        mismatched=[r.index for r in ok if reference is not None and r.text != reference[r.index]],
        wall_s=round(wall, 2),
        requests_per_s=round(len(ok) / wall, 3),
        output_tokens_per_s=round(sum(r.completion_tokens for r in ok) / wall, 1),
        ttft_ms_p50=_percentile([r.ttft_s for r in ok], 50),
        ttft_ms_p99=_percentile([r.ttft_s for r in ok], 99),
        itl_ms_p50=_percentile(itl, 50),
        itl_ms_p99=_percentile(itl, 99),
        tpot_ms_p50=_percentile(tpot, 50),
        acceptance_rate=round(accepted / draft_tokens, 4) if draft_tokens else None,
        mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else None,
        prefix_cache_hit_rate=round(metrics["qspec:prefix_cache_hits_total"] / queries, 4) if queries else None,
        decode_calls={
            k.removeprefix("qspec:decode_calls_total"): v
            for k, v in metrics.items()
            if k.startswith("qspec:decode_calls_total")
        },
    )


def run_load(
    package: str | Path, methods: list[str], options: LoadOptions, *, verify: bool = True, progress=None
) -> list[LoadReport]:
    """One bounded load run per method against a fresh ``qspec serve`` of ``package``; checked against the reference."""
    say = progress or (lambda message: None)
    package = Path(package)
    prompts = mt_bench_prompts(options.requests)
    if len(prompts) < options.requests:
        raise ConfigError(
            f"--requests {options.requests}: MT-bench has {len(prompts)} questions; ask for at most that many"
        )
    runs = []
    for method in methods:
        say(f"{method}: {len(prompts)} requests, {options.concurrency} clients, {options.rate}/s Poisson arrivals")
        runs.append((method, *run_method(package, method, prompts, options)))
    reference = None
    if verify:
        say("reference: the engine's greedy output for every prompt")
        reference = reference_texts(package, prompts, options.max_tokens, spinning=options.spinning)
    return [summarize(method, records, wall, metrics, reference) for method, records, wall, metrics in runs]
