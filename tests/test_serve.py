"""`qspec serve` on a tiny random model: the official openai client against the real uvicorn server.

The server runs in this process (uvicorn in a thread, on a free loopback port) so a test can slow the
engine down (to hold slots busy) and compare with an :class:`Engine` of the same package.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qspec.compile import CompileOptions, compile_package
from qspec.runtime import Engine, SamplingParams
from qspec.serve.server import ServeOptions, build, make_server
from qspec.specializations import make_config

CTX = 128
MODEL = "tiny"
PROMPTS = ["abcabcabcabc", "hello hello hello", "the cat sat on the mat, the cat", "0123456789", "xyz"]


@pytest.fixture(scope="module")
def package(tiny_model, tmp_path_factory):
    """The tiny llama with K in [0, 4] and 4 KV slots."""
    config = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=CTX, full_batch_size=4)
    folder = tmp_path_factory.mktemp("serve") / "pkg"
    return compile_package(tiny_model("llama"), CompileOptions(specialization=config), output=folder)[0]


@pytest.fixture(scope="module")
def engine(package):
    """A separate engine on the same package: the reference outputs."""
    return Engine(package, method="none")


class Server:
    """A running server: its URL, its engine worker, an openai client."""

    def __init__(self, package, **options):
        opts = ServeOptions(
            **{"package": package, "served_model_name": MODEL, "port": 0, "log_level": "warning", **options}
        )
        app, self.worker = build(opts)
        self.uvicorn = make_server(app, opts)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "the server did not start in 30 s"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=30)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, parsed by prometheus_client: ``{'name{label="v"}': value}``."""
        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def slow_engine(self, seconds: float):
        """Make every engine step take ``seconds`` longer (a slow model), until the returned undo is called."""
        engine = self.worker.engine
        step = engine.step

        def slowed():
            time.sleep(seconds)
            return step()

        engine.step = slowed
        return lambda: setattr(engine, "step", step)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(package):
    running = Server(package, max_waiting=8, dispatch="cover")  # drafts are verified whatever they cost: counters move
    yield running
    running.stop()


def reference(engine, prompt, *, chat=False, **params):
    """The engine's output for ``prompt`` alone (one at a time)."""
    [out] = engine.generate([prompt], SamplingParams(**params), chat=chat)
    return out


def test_models_and_health(server, package):
    """/v1/models lists the served name with the context length; /health is 200."""
    [model] = server.client.models.list().data
    assert model.id == MODEL
    assert model.model_extra["max_model_len"] == CTX
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("stop", [None, ["c"]])
def test_completions_greedy_equal_generate(server, engine, stop):
    """Non-streamed greedy completions: text, finish reason and usage equal Engine.generate's."""
    for prompt in PROMPTS:
        ref = reference(engine, prompt, max_new_tokens=24, stop=stop or [])
        got = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop)
        assert got.choices[0].text == ref.text, prompt
        assert got.choices[0].finish_reason == ref.finish_reason
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert got.usage.completion_tokens == len(ref.token_ids)


def test_completions_stream_equal_generate(server, engine):
    """Streamed completions: the chunks add up to Engine.generate's text; include_usage sends a usage chunk."""
    for prompt in PROMPTS[:3]:
        ref = reference(engine, prompt, max_new_tokens=30, ignore_eos=True)
        chunks = list(
            server.client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=30,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert len(chunks) > 2, "text must arrive in several chunks"
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30


def test_chat_stream_and_not_equal_generate(server, engine):
    """Chat, streamed and not: the template of the package's tokenizer, the same text as Engine.generate."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abab abab abab"}]
    ref = reference(engine, messages, max_new_tokens=20)
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20)
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.token_ids)
    chunks = list(
        server.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)  # asked for: in a last chunk of its own


def test_concurrent_arrivals_equal_one_at_a_time(server, engine):
    """Ten requests arriving at different times join the running batch; each equals its one-at-a-time output."""
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 2)]
    refs = [reference(engine, p, max_new_tokens=40, ignore_eos=True).text for p in prompts]
    restore = server.slow_engine(0.005)  # steps long enough that arrivals overlap running requests

    def call(i: int) -> str:
        time.sleep(0.03 * i)
        got = server.client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=40, extra_body={"ignore_eos": True}
        )
        return got.choices[0].text

    before = server.metrics()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(call, range(len(prompts))))
    finally:
        restore()
    assert outputs == refs
    after = server.metrics()
    assert (
        after['qspec:request_success_total{finished_reason="length"}']
        - before['qspec:request_success_total{finished_reason="length"}']
        == 10
    )
    # arrivals joined over time: into an idle engine through prefill calls, into a running batch riding along
    # its decode calls
    joined = {name: after[name] - before[name] for name in ("qspec:prefill_calls_total", "qspec:mixed_calls_total")}
    assert sum(joined.values()) >= 3 and joined["qspec:mixed_calls_total"] >= 1, joined


def test_seeded_sampling_is_reproducible(server):
    """temperature/top_p/top_k/seed reach the sampler: the same seed gives the same text, another seed may not."""

    def sample(seed):
        got = server.client.completions.create(
            model=MODEL,
            prompt="abc",
            max_tokens=20,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            extra_body={"top_k": 50, "ignore_eos": True},
        )
        return got.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_disconnect_mid_stream_frees_the_slot(server):
    """A client that closes a stream aborts its request: the running gauge drops to 0 long before max_tokens."""
    restore = server.slow_engine(0.02)  # 100 tokens would take >= 2 s
    before = server.metrics()
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with (
            httpx.Client(timeout=10) as client,
            client.stream("POST", f"{server.url}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
        closed = time.monotonic()
        while server.metrics()["qspec:num_requests_running"] != 0:
            assert time.monotonic() - closed < 1.5, "the slot was not freed after the disconnect"
            time.sleep(0.02)
    finally:
        restore()
    after = server.metrics()
    assert (
        after['qspec:request_success_total{finished_reason="abort"}']
        == before['qspec:request_success_total{finished_reason="abort"}'] + 1
    )
    assert after["qspec:generation_tokens_total"] - before["qspec:generation_tokens_total"] < 100


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"model": "gpt-4", "prompt": "abc"}, 404, ["gpt-4", MODEL]),
        ({"model": MODEL, "prompt": "abc", "max_tokens": -1}, 400, ["max_tokens"]),
        ({"model": MODEL, "prompt": "x" * (CTX + 10)}, 400, [str(CTX + 10), str(CTX)]),
        ({"model": MODEL, "prompt": "abc", "max_tokens": CTX}, 400, ["max_tokens", str(CTX), str(CTX + 3)]),
        ({"model": MODEL, "prompt": "abc", "n": 17}, 400, ["n"]),
        ({"model": MODEL, "prompt": "abc", "frobnicate": 1}, 400, ["frobnicate"]),
        ({"model": MODEL, "prompt": "abc", "presence_penalty": 0.5}, 400, ["presence_penalty"]),
        ({"model": MODEL, "prompt": ["a", "b"]}, 400, ["one prompt"]),
        ({"model": MODEL, "prompt": "abc", "temperature": -1}, 400, ["temperature"]),
        ({"model": MODEL}, 400, ["prompt"]),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            400,
            ["tools"],
        ),
        ("{not json", 400, ["JSON"]),
    ],
)
def test_bad_requests_get_4xx_with_a_message(server, body, status, words):
    """Bad requests: the status, OpenAI's error shape, a message naming the problem; the server keeps serving."""
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    assert server.client.completions.create(model=MODEL, prompt="abc", max_tokens=2).usage.completion_tokens >= 1


def test_openai_client_raises_on_errors(server):
    """The official client turns the error shape into its exceptions with our message."""
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="nope", prompt="abc")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * CTX}])


def test_metrics_parse_and_count(server):
    """/metrics parses with prometheus_client; tokens, finish reasons, drafts and calls per K move."""
    before = server.metrics()
    server.client.completions.create(
        model=MODEL, prompt="abcdabcdabcdabcd", max_tokens=24, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    moved = {name: after[name] - before.get(name, 0) for name in after}
    assert moved["qspec:generation_tokens_total"] == 24
    assert moved["qspec:prompt_tokens_total"] > 0
    assert moved['qspec:request_success_total{finished_reason="length"}'] == 1
    assert moved["qspec:time_to_first_token_seconds_count"] == 1
    assert moved["qspec:inter_token_latency_seconds_count"] >= 1
    assert moved["qspec:spec_decode_num_drafts_total"] >= 1, "the repeating prompt must have drafted"
    assert moved["qspec:spec_decode_num_draft_tokens_total"] >= moved["qspec:spec_decode_num_accepted_tokens_total"]
    per_pos = sum(v for k, v in moved.items() if k.startswith("qspec:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == moved["qspec:spec_decode_num_accepted_tokens_total"]
    assert moved['qspec:decode_calls_total{k="0"}'] + moved['qspec:decode_calls_total{k="4"}'] >= 1
    assert after["qspec:num_requests_running"] == 0 and after["qspec:num_requests_waiting"] == 0


def test_full_queue_gets_429(package):
    """One slot and one waiting place: a third concurrent request gets 429 with a message."""
    small = Server(package, max_batch_size=1, max_waiting=1)
    restore = small.slow_engine(0.02)
    try:

        def long_request():
            return small.client.completions.create(
                model=MODEL, prompt="abc", max_tokens=40, extra_body={"ignore_eos": True}
            )

        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(long_request) for _ in range(2)]
            deadline = time.monotonic() + 5
            while small.metrics()["qspec:num_requests_waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError, match="busy"):
                long_request()
            assert all(f.result().usage.completion_tokens == 40 for f in running)
    finally:
        restore()
        small.stop()


def test_cli_serve_and_sigterm(package, tmp_path):
    """`qspec serve` answers, and on SIGTERM finishes its in-flight stream and shuts down cleanly."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "qspec",
        "serve",
        str(package),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--method",
        "suffix",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "qspec serve did not come up"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model=MODEL,
            prompt="abc",
            max_tokens=60,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # the stream has begun
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert rest[-1].usage.completion_tokens == 60 and rest[-2].choices[0].finish_reason == "length"
        assert proc.wait(30) == 0, proc.stdout.read().decode()  # a graceful shutdown
        log = proc.stdout.read().decode()
        assert "Application shutdown complete" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_load_clients_report_every_request(package, engine):
    """The load run's clients: Poisson arrivals, streamed, every request recorded and equal to the reference."""
    import asyncio

    from qspec.serve.load import LoadOptions, run_clients, summarize

    running = Server(package, served_model_name="load")  # the name the load clients send
    try:
        prompts = [p[:12] for p in PROMPTS] * 2
        refs = [reference(engine, p, max_new_tokens=12, chat=True).text for p in prompts]
        options = LoadOptions(requests=len(prompts), concurrency=4, rate=50, max_tokens=12)
        records, wall = asyncio.run(run_clients(running.url, prompts, options))
        report = summarize("none", records, wall, running.metrics(), refs)
    finally:
        running.stop()
    assert (report.completed, report.failed, report.mismatched) == (len(prompts), 0, [])
    assert report.ttft_ms_p50 > 0 and report.output_tokens_per_s > 0


@pytest.mark.slow
def test_smollm2_concurrent_chat_equals_generate(tmp_path, monkeypatch):
    """The real model, 2 KV slots, prompt lookup: 8 concurrent MT-bench chats equal Engine.generate's greedy text."""
    from pathlib import Path

    from tests.test_smollm2 import mt_bench_prompts, smollm2_path

    monkeypatch.setenv(
        "QSPEC_CACHE_DIR", os.environ.get("QSPEC_REAL_CACHE_DIR") or str(Path.home() / ".cache" / "qspec")
    )
    config = make_config(num_speculative_tokens="0,4", prefill_seq_len=32, ctx_len=512, full_batch_size=2)
    package = compile_package(smollm2_path(), CompileOptions(specialization=config), output=tmp_path / "pkg")[0]
    prompts = mt_bench_prompts()
    refs = [
        o.text for o in Engine(package, method="none").generate(prompts, SamplingParams(max_new_tokens=48), chat=True)
    ]
    server = Server(package, method="pld", dispatch="cover")
    server.client = server.client.with_options(timeout=600)  # a shared machine may be slow
    try:

        def chat(i: int) -> str:
            time.sleep(0.2 * i)
            messages = [{"role": "user", "content": prompts[i]}]
            return (
                server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
                .choices[0]
                .message.content
            )

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(chat, range(len(prompts)))) == refs
        assert server.metrics()["qspec:spec_decode_num_drafts_total"] > 0
    finally:
        server.stop()


@pytest.mark.parametrize(
    "args,words",
    [
        (["--port", "TAKEN"], ["cannot listen on 127.0.0.1:", "--port"]),
        (["--host", "no-such-host.invalid"], ["--host 'no-such-host.invalid'"]),
        (["--log-level", "loud"], ["--log-level 'loud'", "debug"]),
        (["--served-model-name", ""], ["--served-model-name is empty"]),
    ],
)
def test_serve_startup_failures_are_one_line_before_the_load(tmp_path, args, words):
    """A taken port, a bad host, an unknown log level, an empty model name: one `Error:` line and exit 1,
    before the package is read (the package here does not exist)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = [str(taken.getsockname()[1]) if a == "TAKEN" else a for a in args]
        cmd = [sys.executable, "-m", "qspec", "serve", str(tmp_path / "nope"), *args]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    for word in words:
        assert word in lines[0]


def test_api_key_is_required_when_set(package):
    """With --api-key, /v1 routes answer 401 in OpenAI's error shape without the key and serve with it."""
    running = Server(package, api_key="sesame")
    try:
        denied = httpx.get(f"{running.url}/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{running.url}/health").status_code == 200  # probes need no key
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="sesame", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="abc", max_tokens=2).choices[0].text is not None
    finally:
        running.stop()
