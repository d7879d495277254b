"""The OpenAI API surface a client library expects of `qspec serve`, on a tiny random model: logprobs (chat and
completions), echo, ``n`` choices, stop arrays, unknown routes, stream chunks as OpenAI sends them, the
too-long-prompt hint in the request's terms, and the exit code of a graceful SIGINT."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from qspec.compile import CompileOptions, compile_package
from qspec.runtime import Engine
from qspec.specializations import make_config
from tests.test_serve import CTX, MODEL, Server, reference


@pytest.fixture(scope="module")
def package(tiny_model, tmp_path_factory):
    """The tiny llama with K in [0, 4] and 4 KV slots."""
    config = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=CTX, full_batch_size=4)
    folder = tmp_path_factory.mktemp("serve-api") / "pkg"
    return compile_package(tiny_model("llama"), CompileOptions(specialization=config), output=folder)[0]


@pytest.fixture(scope="module")
def engine(package):
    return Engine(package, method="none")


@pytest.fixture(scope="module")
def spec_server(package):
    """Prompt lookup, every draft verified (dispatch cover): speculation happens on repetitive prompts."""
    running = Server(package, method="pld", dispatch="cover")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def plain_server(package):
    running = Server(package, method="none")
    yield running
    running.stop()


def events(url: str, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response, raw (what is on the wire, before any client parses it)."""
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_stream_chunks_carry_usage_only_when_asked(plain_server):
    """As OpenAI streams: no ``usage`` key unless ``stream_options.include_usage``; then ``usage: null`` in every
    chunk but a last one with no choices and the counts."""
    body = {"model": MODEL, "prompt": "abcabc", "max_tokens": 6, "stream": True}
    plain = events(plain_server.url, "/v1/completions", body)
    assert plain and all("usage" not in c for c in plain), plain
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    assert all("usage" not in c for c in events(plain_server.url, "/v1/chat/completions", chat))
    counted = events(plain_server.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in counted[:-1])
    assert counted[-1]["choices"] == [] and counted[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    "body, hint",
    [
        (
            {"prompt": "x" * (CTX + 10), "max_tokens": 5},
            f"shorten the prompt to {CTX - 5} tokens or fewer for max_tokens=5",
        ),
        ({"prompt": "abc", "max_tokens": CTX}, f"lower max_tokens to {CTX - 3}"),
        ({"messages": [{"role": "user", "content": "y" * CTX}]}, f"shorten the prompt to {CTX - 1} tokens or fewer"),
    ],
)
def test_too_long_prompt_hint_is_in_the_request_terms(plain_server, body, hint):
    """The 400's hint uses the request's max_tokens and names no command-line flag (an HTTP client has none)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(f"{plain_server.url}{path}", json={"model": MODEL, **body})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert hint in message and "--" not in message, message


def test_unknown_routes_get_openai_error_shape(plain_server):
    """A route the server does not have: 404 in OpenAI's error shape, naming the routes it has."""
    for method, path in [("GET", "/v1/nope"), ("POST", "/v1/embeddings"), ("GET", "/")]:
        response = httpx.request(method, f"{plain_server.url}{path}")
        assert response.status_code == 404
        error = response.json()["error"]
        assert (
            error["code"] == "unknown_url" and path in error["message"] and "/v1/chat/completions" in error["message"]
        )


def test_speculative_logprobs_equal_plain_logprobs(spec_server, plain_server):
    """Greedy, through the openai client: a speculative server (drafts accepted) returns the tokens,
    log-probabilities and alternatives a plain server returns, in completions and in chat."""
    before = spec_server.metrics()["qspec:spec_decode_num_accepted_tokens_total"]
    kwargs = dict(model=MODEL, prompt="abcabcabcabcabcabc", max_tokens=24, logprobs=3, temperature=0)
    spec = spec_server.client.completions.create(**kwargs).choices[0]
    plain = plain_server.client.completions.create(**kwargs).choices[0]
    assert spec_server.metrics()["qspec:spec_decode_num_accepted_tokens_total"] > before, "nothing was speculated"
    assert spec.text == plain.text and spec.logprobs.tokens == plain.logprobs.tokens
    assert len(spec.logprobs.tokens) == 24
    assert spec.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    for got, want in zip(spec.logprobs.top_logprobs, plain.logprobs.top_logprobs):
        assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hello hello"}], max_tokens=24, temperature=0)
    spec = spec_server.client.chat.completions.create(**chat, logprobs=True, top_logprobs=3).choices[0]
    plain = plain_server.client.chat.completions.create(**chat, logprobs=True, top_logprobs=3).choices[0]
    assert spec.message.content == plain.message.content
    got, want = spec.logprobs.content, plain.logprobs.content
    assert [t.token for t in got] == [t.token for t in want] and len(got) == 24
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-4)
    for g, w in zip(got, want):
        assert [a.token for a in g.top_logprobs] == [a.token for a in w.top_logprobs] and len(g.top_logprobs) == 3
        assert g.top_logprobs[0].logprob >= g.logprob - 1e-9  # greedy: the chosen token is the most likely
        assert bytes(g.bytes).decode() == g.token
    assert spec_server.client.chat.completions.create(**chat).choices[0].logprobs is None  # not asked, not sent


def test_streamed_logprobs_equal_whole(spec_server):
    """Streamed chat logprobs, chunk by chunk, add up to the non-streamed response's."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "xyzxyzxyz"}], max_tokens=16, logprobs=True)
    whole = spec_server.client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        t
        for c in spec_server.client.chat.completions.create(**kwargs, stream=True)
        for t in (c.choices[0].logprobs.content or [])
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]


def test_completion_logprobs_and_echo(plain_server, engine):
    """Completions: ``logprobs=N`` gives every token, its log-probability, N alternatives and text offsets;
    ``echo`` puts the prompt before the text."""
    ref = reference(engine, "hello hello", max_new_tokens=10)
    choice = plain_server.client.completions.create(
        model=MODEL, prompt="hello hello", max_tokens=10, logprobs=2
    ).choices[0]
    lp = choice.logprobs
    assert choice.text == ref.text
    assert lp.tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert len(lp.token_logprobs) == 10 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) <= 2 and max(top.values()) >= x - 1e-9 for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    echoed = plain_server.client.completions.create(model=MODEL, prompt="hello hello", max_tokens=10, echo=True)
    assert echoed.choices[0].text == "hello hello" + ref.text
    with pytest.raises(openai.BadRequestError, match="echo with logprobs"):
        plain_server.client.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True, logprobs=1)


def test_n_choices_and_stop_arrays(spec_server, engine):
    """``n=3`` greedy: three choices, each the one-at-a-time output, usage summing them; streamed, every
    choice's chunks carry its index; a stop array stops at the first of its strings."""
    ref = reference(engine, "the cat sat on the mat", max_new_tokens=12)
    reply = spec_server.client.completions.create(model=MODEL, prompt="the cat sat on the mat", max_tokens=12, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2] and {c.text for c in reply.choices} == {ref.text}
    assert reply.usage.completion_tokens == 3 * len(ref.token_ids)
    chunks = list(
        spec_server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "abab"}], max_tokens=8, n=2, stream=True
        )
    )
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1]
    full = reference(engine, "0123456789", max_new_tokens=20).text
    stops = [s for s in (full[5:7], full[9:11]) if s]
    cut = reference(engine, "0123456789", max_new_tokens=20, stop=stops)
    got = spec_server.client.completions.create(model=MODEL, prompt="0123456789", max_tokens=20, stop=stops).choices[0]
    assert (got.text, got.finish_reason) == (cut.text, cut.finish_reason)


def test_graceful_sigint_exits_0(package):
    """`qspec serve` ends with exit code 0 on SIGINT (a terminal's Ctrl-C or `kill -INT`) and on SIGTERM,
    after its shutdown: one documented code, whatever the signal's disposition was."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "qspec", "serve", str(package), "--port", str(port), "--method", "none"]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.stdout.read().decode()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "qspec serve did not come up"
                time.sleep(0.1)
            proc.send_signal(sig)
            code = proc.wait(30)
            log = proc.stdout.read().decode()
            assert code == 0 and "Application shutdown complete" in log, (sig, code, log)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_spec_metrics_per_request_when_asked(spec_server):
    """``return_spec_metrics``: each choice's drafts, draft tokens, accepted tokens and accepted tokens per
    position, equal to what /metrics counted for it; absent unless asked."""
    before = spec_server.metrics()
    body = {"model": MODEL, "prompt": "abcabcabcabcabcabc", "max_tokens": 24, "return_spec_metrics": True}
    reply = httpx.post(f"{spec_server.url}/v1/completions", json=body, timeout=30).json()
    after = spec_server.metrics()
    moved = {name: after[name] - before.get(name, 0) for name in after}
    stats = reply["choices"][0]["spec_decode"]
    assert stats["num_accepted_tokens"] > 0
    assert stats["num_drafts"] == moved["qspec:spec_decode_num_drafts_total"]
    assert stats["num_draft_tokens"] == moved["qspec:spec_decode_num_draft_tokens_total"]
    assert (
        stats["num_accepted_tokens"]
        == moved["qspec:spec_decode_num_accepted_tokens_total"]
        == sum(stats["accepted_per_position"])
    )
    per_pos = [moved[f'qspec:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(4)]
    assert stats["accepted_per_position"] == per_pos
    streamed = events(spec_server.url, "/v1/completions", {**body, "stream": True})
    assert streamed[-1]["choices"][0]["spec_decode"] == stats
    assert all("spec_decode" not in c["choices"][0] for c in streamed[:-1])
    plain = httpx.post(f"{spec_server.url}/v1/completions", json={**body, "return_spec_metrics": False}).json()
    assert "spec_decode" not in plain["choices"][0]
