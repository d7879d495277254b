"""Prefix reuse: a finished request's KV stays in its slot and the next request that starts with its tokens
prefills only the rest; answers equal a cold server's, on a tiny random model whose KV cache has more slots
than its decode calls have rows (``--kv-cache-batch-size``): idle slots keep more conversations warm."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from qspec.compile import CompileOptions, compile_package
from qspec.runtime import Engine, SamplingParams
from qspec.runtime.prefix import PrefixCache, common_prefix
from qspec.specializations import make_config
from tests.test_serve import CTX, MODEL, Server

SYSTEM = "You answer in letters. " * 3  # a long shared prefix: several prefill chunks of 8 tokens


@pytest.fixture(scope="module")
def package(tiny_model, tmp_path_factory):
    """The tiny llama with K in [0, 4], 2 sequences decoded per call in 6 KV slots, 8-token prefill chunks (a
    reused prefix ends mid-chunk)."""
    config = make_config(
        num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=CTX * 4, full_batch_size=2, kv_cache_batch_size=6
    )
    folder = tmp_path_factory.mktemp("serve-prefix") / "pkg"
    return compile_package(tiny_model("llama"), CompileOptions(specialization=config), output=folder)[0]


def test_common_prefix_and_slot_choice():
    """A slot the prompt extends whole first (an unused one before another conversation's), then the longest
    shared prefix, then the least recently released slot; never the whole prompt."""
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0
    cache = PrefixCache(4, enabled=True)
    cache.release(0, [5, 6, 7])
    cache.release(1, [1, 2, 3, 4])
    cache.release(3, [1, 2, 3, 5])
    assert cache.take([1, 2, 3, 4, 8], free=[0, 1, 2, 3]) == (1, 4)  # its own slot
    assert cache.take([1, 2, 9], free=[0, 2, 3]) == (2, 0)  # slot 2 is unused: slot 3's conversation stays
    assert cache.take([1, 2, 9], free=[0, 3]) == (3, 2)  # the longest shared prefix
    assert cache.take([5, 6, 7], free=[0]) == (0, 2)  # the last prompt token is prefilled again
    assert (cache.queries, cache.hits) == (14, 8)
    off = PrefixCache(2, enabled=False)
    off.release(1, [1, 2, 3])
    assert off.take([1, 2, 3, 4], free=[0, 1]) == (0, 0) and off.queries == 0


def conversation(client, turns: list[str], *, max_tokens: int = 12) -> list[str]:
    """A chat resent whole each turn, as chat clients do: the answers, turn by turn."""
    messages, answers = [{"role": "system", "content": SYSTEM}], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
        answers.append(reply.choices[0].message.content)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


def test_conversation_equals_a_cold_server_and_counts_hits(package):
    """A 4-turn conversation, then four at once: a server reusing prefixes answers what a server without
    (--no-prefix-cache) answers; /metrics counts the reused tokens, the cold server reuses none."""
    turns = ["abc abc", "def def def", "abc def", "xyz"]
    answers, hits = {}, {}
    for reuse in (True, False):
        running = Server(package, method="pld", prefix_cache=reuse, dispatch="cover")
        try:
            one = conversation(running.client, turns)
            with ThreadPoolExecutor(4) as pool:  # slots taken and retaken concurrently, chunks mixed with decodes
                rotations = [turns[i:] + turns[:i] for i in range(4)]
                many = list(pool.map(conversation, [running.client] * 4, rotations))
            answers[reuse] = (one, many)
            metrics = running.metrics()
            hits[reuse] = (metrics["qspec:prefix_cache_hits_total"], metrics["qspec:prefix_cache_queries_total"])
        finally:
            running.stop()
    assert answers[True] == answers[False]
    assert hits[False] == (0, 0)
    found, asked = hits[True]
    assert asked > 0 and found / asked > 0.5, hits  # turns 2-4 of every conversation resend the whole chat


def test_engine_prefix_cache_equals_plain(package):
    """Offline: prompts sharing prefixes, more than the slots (later ones join mid-batch), reuse on or off."""
    prompts = [SYSTEM + tail for tail in ["a", "ab", "abc", "b", "ba", "SYSTEM", "a b c d e f"]]
    params = SamplingParams(max_new_tokens=10)
    cold = [o.token_ids for o in Engine(package, method="pld").generate(prompts, params)]
    warm_engine = Engine(package, method="pld", prefix_cache=True)
    warm = [o.token_ids for o in warm_engine.generate(prompts, params)]
    again = [o.token_ids for o in warm_engine.generate(prompts, params)]
    assert warm == cold and again == cold
    assert warm_engine.prefix.hits > 0


def test_kv_slots_beyond_the_decode_batch(package):
    """`--kv-cache-batch-size 6 --full-batch-size 2`: QEfficient's specializations (decode rows 2, every shape's
    full_batch_size symbol 6) in the package's specializations.json; the engine runs 2 requests at once and
    keeps 5 conversations warm: their next turns reuse every token of the first, answers equal to plain."""
    import json

    specs = [s for s in json.loads((package / "specializations.json").read_text())["specializations"]]
    assert [(s["batch_size"], s["seq_len"], s["full_batch_size"]) for s in specs] == [
        ("1", "8", "6"),
        ("2", "1", "6"),
        ("2", "5", "6"),
    ]
    plain = Engine(package, method="none")
    warm = Engine(package, method="pld", prefix_cache=True)
    assert (warm.num_slots, warm.kv_slots) == (2, 6)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    firsts = [f"{SYSTEM}{i}" for i in range(5)]
    turn1 = warm.generate(firsts, params)
    seconds = [o.prompt_token_ids + o.token_ids + warm.tokenizer.encode(" more") for o in turn1]
    hits = warm.prefix.hits
    turn2 = warm.generate(seconds, params)
    assert warm.prefix.hits - hits == sum(len(o.prompt_token_ids) + 7 for o in turn1)  # the last token is not kept
    assert [o.token_ids for o in turn1 + turn2] == [o.token_ids for o in plain.generate(firsts + seconds, params)]


def test_engine_prefix_reuse_with_aborts_equals_plain(package):
    """Random arrivals extending earlier prompts and answers (partial and whole-prompt matches, prefixes ending
    mid-chunk, prompts admitted mid-batch), random aborts mid-prefill and mid-decode whose KV is kept: every
    finished request's tokens are the plain engine's, and its text is its tokens decoded."""
    import random

    plain = Engine(package, method="none")
    warm = Engine(package, method="pld", prefix_cache=True)
    rng = random.Random(0)
    histories, live, checked = [warm.tokenizer.encode(SYSTEM)], {}, 0
    for step in range(100):
        if rng.random() < 0.5 and len(live) < 6:
            ids = rng.choice(histories) + [rng.randrange(3, 259) for _ in range(rng.randint(0, 10))]
            live[warm.add_request(ids, SamplingParams(max_new_tokens=rng.randint(1, 16), ignore_eos=True))] = ids
        if live and rng.random() < 0.12:
            warm.abort(rng.choice(list(live)))
        for delta in warm.step() if warm.has_unfinished() else []:
            if not delta.finished:
                continue
            ids, out = live.pop(delta.request_id), delta.output
            if delta.finish_reason == "abort":
                continue
            params = SamplingParams(max_new_tokens=len(out.token_ids), ignore_eos=True)
            assert out.token_ids == plain.generate([ids], params)[0].token_ids, (step, ids)
            assert out.text == warm.tokenizer.decode(out.token_ids)
            histories.append(ids + out.token_ids)
            checked += 1
    assert checked > 12 and warm.prefix.hits > warm.prefix.queries / 3, (checked, warm.prefix.hits)


def test_shared_prefix_load_with_leavers_equals_plain(package):
    """Concurrent requests sharing a prefix, streams that leave after their first chunk (aborted mid-prefill or
    mid-decode, their KV kept), then the same prompts again: every answer is the plain engine's. (Answers once
    lost their last characters when a speculative step pushed a half character last: the text stream now
    flushes at the end, tests/test_runtime.py::test_text_stream_text_is_the_decoded_ids_however_they_are_pushed.)"""
    import httpx

    prompts = [f"abcabc {i}" for i in range(16)]
    refs = [
        o.text
        for o in Engine(package, method="none").generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    ]
    running = Server(package, method="pld")  # reuse is the default
    try:
        running.slow_engine(0.005)

        def ask(i: int) -> str:
            reply = running.client.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=24, extra_body={"ignore_eos": True}
            )
            return reply.choices[0].text

        def leave(i: int) -> None:
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 24, "stream": True}
            with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=60) as response:
                next(response.iter_lines())

        with ThreadPoolExecutor(8) as pool:
            leavers = [pool.submit(leave, i) for i in range(4)]
            first = list(pool.map(ask, range(len(prompts))))
            again = list(pool.map(ask, range(len(prompts))))
            for future in leavers:
                future.result()
        assert running.metrics()["qspec:prefix_cache_hits_total"] > 0
    finally:
        running.stop()
    assert first == refs and again == refs
