"""The runtime on tiny random models: speculative greedy output equals plain greedy, edge cases hold."""

from __future__ import annotations

import json

import pytest

from qspec.compile import CompileOptions, compile_package
from qspec.errors import ConfigError, PackageError, PromptTooLongError
from qspec.runtime import Engine, SamplingParams, pick_k
from qspec.runtime.metrics import step_times
from qspec.specializations import make_config

CTX = 64
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # repeats: prompt lookup finds drafts
    [9, 10, 11, 12, 13, 9, 10, 11],
    [20, 21, 22] * 5,
    list(range(30, 60)),  # no repeats: nothing to propose
    [40, 41, 40, 41, 40],
]


def compile_tiny(model, folder, ks, *, fbs=None, prefill=8, ctx=CTX):
    """A package that also ships the vendor graph: tests here run model.onnx beside the runtime graph."""
    options = CompileOptions(
        specialization=make_config(
            num_speculative_tokens=ks, prefill_seq_len=prefill, ctx_len=ctx, full_batch_size=fbs
        ),
        vendor_graph=True,
    )
    package, _, _ = compile_package(model, options, output=folder)
    return package


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def packages(model, tmp_path_factory):
    """Packages of one tiny model: Ks [0,4], [4], [0,1,2,4,8] at batch 1, and [0,4] with 4 KV slots."""
    root = tmp_path_factory.mktemp("packages")
    return {
        "0,4": compile_tiny(model, root / "k04", "0,4"),
        "4": compile_tiny(model, root / "k4", "4"),
        "0,1,2,4,8": compile_tiny(model, root / "kdense", "0,1,2,4,8"),
        "cb": compile_tiny(model, root / "cb", "0,4", fbs=4),
    }


@pytest.fixture(scope="module")
def reference(model):
    """transformers greedy continuation of ``prompt`` (HF generate, no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    cache = {}

    def greedy(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return greedy


def run(package, prompts, *, n=20, **engine_options):
    engine = Engine(package, **engine_options)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outputs], engine


def test_pick_k_is_the_smallest_covering_k():
    """pick_k buckets a proposal length into the compiled Ks; longer proposals take the largest K."""
    assert pick_k([0, 4], 0) == 0
    assert pick_k([0, 4], 1) == 4  # one draft needs seq_len 2: K=4 is the smallest that covers it
    assert pick_k([0, 4], 4) == 4
    assert pick_k([0, 1, 2, 4, 8], 3) == 4
    assert pick_k([4], 0) == 4  # nothing proposed and no K=0: the smallest K
    assert pick_k([0, 4], 9) == 4


@pytest.mark.parametrize("ks", ["0,4", "4", "0,1,2,4,8"])
def test_speculative_greedy_equals_plain_greedy_and_transformers(packages, reference, ks):
    """pld output of every K list equals `none` of the same package and transformers greedy, with the
    default dispatch (which verifies the drafts that pay at the calls' measured prices: on a tiny model's
    ~1 ms calls, few or none) and with `cover` (every draft verified, some accepted)."""
    plain, _ = run(packages[ks], PROMPTS, method="none")
    spec, _ = run(packages[ks], PROMPTS, method="pld")
    assert spec == plain
    covered, engine = run(packages[ks], PROMPTS, method="pld", dispatch="cover")
    assert covered == plain
    for prompt, tokens in zip(PROMPTS, plain):
        assert tokens == reference(prompt, 20)
    assert engine.last_metrics.proposed > 0, "the repeating prompts must have produced drafts"
    assert engine.last_metrics.accepted > 0


def test_continuous_batching_equals_batch_one(packages, reference):
    """4 KV slots, 5 requests of different lengths and budgets: each equals its batch-1 greedy run."""
    engine = Engine(packages["cb"], method="pld")
    budgets = [20, 7, 13, 3, 16]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets]
    outputs = engine.generate(PROMPTS, params)
    for prompt, n, out in zip(PROMPTS, budgets, outputs):
        assert out.token_ids == reference(prompt, n)
        assert out.finish_reason == "length"
    # the 5th request took a freed slot while the others decoded: its prompt rode along a decode call
    first_four = sum(-(-len(prompt) // 8) for prompt in PROMPTS[:4])  # their chunks of prefill_seq_len 8
    assert engine.last_metrics.calls["prefill"] == first_four and engine.mixed_calls >= 1


@pytest.mark.parametrize("method", ["none", "pld"])
def test_prompts_admitted_mid_batch_ride_along_decode_calls(packages, reference, method):
    """8 requests through 4 KV slots, prompts of 3 to 30 tokens (up to 4 chunks of 8): a request admitted
    while others decode has its prompt written a chunk per decode call, beside rows verifying drafts, and
    every output still equals its transformers greedy run; the decoding rows gained tokens meanwhile."""
    prompts = [*PROMPTS, list(range(60, 90)), [7, 8, 9] * 7, [50, 51, 52]]
    budgets = [5, 18, 9, 3, 14, 11, 6, 12]
    # cover dispatch: every proposal is verified (cost dispatch may price a tiny model's drafts out on a busy machine)
    engine = Engine(packages["cb"], method=method, dispatch="cover")
    assert engine.model.mixes_prefill
    outputs = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets])
    for prompt, n, out in zip(prompts, budgets, outputs):
        assert out.token_ids == reference(prompt, n)
    # only the first four prompts went through prefill calls (chunks of prefill_seq_len 8)
    assert engine.last_metrics.calls["prefill"] == sum(-(-len(prompt) // 8) for prompt in prompts[:4])
    assert engine.mixed_calls >= 4 + 3  # the 30-token prompt alone took 4 chunks
    if method == "pld":
        assert engine.last_metrics.accepted > 0


def test_mixed_calls_off_on_static_sessions(packages, reference):
    """One session per compiled shape (``session_mode="static"``) takes no wider call: prompts go through
    prefill calls as before, with the same outputs."""
    engine = Engine(packages["cb"], method="pld", session_mode="static")
    assert not engine.model.mixes_prefill
    budgets = [20, 7, 13, 3, 16]
    outputs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets])
    assert [o.token_ids for o in outputs] == [reference(p, n) for p, n in zip(PROMPTS, budgets)]
    assert engine.last_metrics.calls["prefill"] > sum(-(-len(prompt) // 8) for prompt in PROMPTS[:4])
    assert engine.mixed_calls == 0


def test_every_row_padded_but_one(packages, reference):
    """One request in a 4-slot package: three rows are padding in every call and change nothing."""
    tokens, engine = run(packages["cb"], [PROMPTS[0]], method="pld")
    assert tokens == [reference(PROMPTS[0], 20)]


def test_partial_acceptance_then_longer_draft(packages, reference):
    """Draft 2 right + 2 wrong (K=4, stale KV left), then 4 right: output is still exact greedy."""
    prompt = PROMPTS[3]
    truth = reference(prompt, 20)
    steps = []

    def drafts(request_id, history):
        made = len(history) - len(prompt)  # tokens generated so far
        steps.append(made)
        if len(steps) == 1:
            return [truth[made], truth[made + 1], 1, 1]  # 2 accepted, then rejected
        return truth[made : made + 4]  # all accepted

    engine = Engine(packages["0,4"], method="user", fn=drafts, dispatch="cover")  # every draft verified
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert out.token_ids == truth
    assert out.metrics.accepted == out.metrics.proposed - 2  # only the two wrong drafts were rejected
    assert steps[:2] == [1, 4]  # after prefill 1 token; then 2 accepted + bonus = 3 more


def test_force_accept_knob_reaches_each_dispatch_path(packages):
    """force_accept=1 accepts exactly one draft per call whatever the target says."""
    engine = Engine(packages["0,4"], method="user", fn=lambda r, h: [7, 7, 7, 7], force_accept=1, dispatch="cover")
    [out] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=9, ignore_eos=True))
    assert out.metrics.accepted == out.metrics.target_calls
    assert out.token_ids[1::2][:4] == [7, 7, 7, 7]  # every other token is the forced draft


def test_sequence_reaches_the_last_context_slot(model, tmp_path, reference):
    """A prompt of 50 tokens in ctx 64: generation stops at capacity, exact, drafts cut in time."""
    package = compile_tiny(model, tmp_path / "pkg", "0,4")
    prompt = [20, 21, 22] * 16 + [20, 21]
    tokens, engine = run(package, [prompt], n=100, method="pld")
    # positions 0..63 hold prompt + all but the last generated token: 64 - 50 + 1 tokens
    assert len(tokens[0]) == CTX - len(prompt) + 1
    assert tokens[0] == reference(prompt, CTX - len(prompt) + 1)


def test_eos_inside_an_accepted_draft(packages, reference):
    """The target accepts a draft that contains EOS: output stops at EOS, nothing after it."""
    prompt = PROMPTS[3]
    truth = reference(prompt, 20)
    engine = Engine(packages["0,4"], method="user", fn=lambda r, h: truth[len(h) - len(prompt) :][:4])
    engine.eos_token_ids = frozenset({truth[3]})
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=20))
    stop = truth.index(truth[3])
    assert out.token_ids == truth[: stop + 1]
    assert out.finish_reason == "stop"
    assert out.metrics.target_calls == 1  # the first verify accepted up to and including EOS


def test_prompt_longer_than_context_is_a_clear_error(packages):
    """A prompt over ctx_len fails before any call, naming both lengths."""
    engine = Engine(packages["0,4"], method="pld")
    with pytest.raises(PromptTooLongError, match="70 tokens but the package's ctx_len is 64"):
        engine.generate([list(range(3, 73))])


def test_stop_string_and_text(packages):
    """A stop string cuts the text where it starts and ends the request."""
    engine = Engine(packages["0,4"], method="pld")
    [full] = engine.generate(["abcabcabc"], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert len(full.text) > 4
    stop = full.text[2:4]
    [cut] = engine.generate(["abcabcabc"], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_chat_prompt_uses_the_template(packages):
    """--chat renders the tokenizer's template before encoding."""
    engine = Engine(packages["0,4"], method="none")
    ids = engine.tokenizer.encode_prompt("hi", chat=True)
    assert engine.tokenizer.decode(ids, skip_special_tokens=False) == "<s>user: hi</s><s>assistant: "


def test_metrics_are_consistent(packages):
    """Aggregates add up: calls per K sum to decode calls, acceptance within [0, 1]."""
    _, engine = run(packages["0,1,2,4,8"], PROMPTS, method="pld")
    m = engine.last_metrics
    decode_calls = sum(v for k, v in m.calls.items() if k != "prefill")
    assert decode_calls == m.sequence_calls  # batch 1: one sequence per call
    assert 0 < m.acceptance_rate <= 1
    assert m.mean_accepted_tokens == pytest.approx((m.accepted + m.sequence_calls) / m.sequence_calls, abs=1e-3)
    assert m.output_tokens == 20 * len(PROMPTS)
    # Where the wall time went: the target's prefill and decode calls, drafting; the host has the rest.
    assert set(m.seconds) == {"prefill", "decode", "propose"}
    assert m.seconds["prefill"] > 0 and m.seconds["decode"] > 0 and m.seconds["propose"] > 0
    assert sum(m.seconds.values()) < m.wall_s
    step = step_times(m.wall_s, m.calls, m.seconds)
    assert step.host_ms > 0 and 0 < step.host_share < 1


def test_subset_of_ks_and_unknown_method(packages):
    """Dispatch can be limited to compiled Ks; other Ks and unknown methods are clear errors."""
    tokens, engine = run(packages["0,1,2,4,8"], PROMPTS[:2], method="pld", num_speculative_tokens="0,4")
    assert set(engine.last_metrics.calls) == {"prefill", "0", "4"}
    with pytest.raises(ConfigError, match=r"\[3\] not compiled"):
        Engine(packages["0,4"], num_speculative_tokens="0,3")
    with pytest.raises(ConfigError, match="valid methods"):
        Engine(packages["0,4"], method="magic")


def test_sampling_is_reproducible_with_a_seed(packages):
    """temperature > 0 with a seed gives the same tokens twice, and speculation keeps running."""
    engine = Engine(packages["0,4"], method="pld")
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_corrupt_package_is_a_clear_error(packages, tmp_path):
    """A package with a broken manifest or a missing graph names the problem and the fix."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(packages["0,4"], broken)
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(PackageError, match="corrupt.*qspec compile"):
        Engine(broken)
    manifest = json.loads((packages["0,4"] / "manifest.json").read_text())
    (broken / "manifest.json").write_text(json.dumps(manifest))
    (broken / "model.onnx").unlink()
    with pytest.raises(PackageError, match="missing model.onnx"):
        Engine(broken)
    with pytest.raises(PackageError, match="does not exist"):
        Engine(tmp_path / "nowhere")


def test_runtime_does_not_import_torch(packages):
    """A compiled package runs with onnxruntime and numpy only."""
    import subprocess
    import sys

    code = (
        "import sys; from qspec.runtime import Engine, SamplingParams;"
        f"e = Engine({str(packages['0,4'])!r}); e.generate([[5, 6, 5, 6]], SamplingParams(max_new_tokens=4));"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cost_dispatch_keeps_greedy_output(packages, reference):
    """dispatch='cost' may cut drafts but never changes tokens, batch 1 and 4 slots."""
    for package in (packages["0,1,2,4,8"], packages["cb"]):
        tokens, engine = run(package, PROMPTS, method="pld", dispatch="cost")
        for prompt, out in zip(PROMPTS, tokens):
            assert out == reference(prompt, 20)
        assert set(engine.dispatcher.prices) == set(engine.ks)
    with pytest.raises(ConfigError, match="dispatch"):
        Engine(packages["0,4"], dispatch="fastest")


def test_static_session_mode_equals_shared(packages):
    """One fully static session per specialization gives the same tokens as the shared session."""
    shared, _ = run(packages["0,4"], PROMPTS[:3], method="pld")
    static, engine = run(packages["0,4"], PROMPTS[:3], method="pld", session_mode="static")
    assert static == shared
    sessions = {bound.session for bound in engine.model.bindings.values()}
    assert len(sessions) == len(engine.model.bindings)  # one session per specialization


def test_streamed_text_ends_where_the_stop_string_starts(packages):
    """Streaming with a stop string delivers exactly the returned text, up to the stop."""
    engine = Engine(packages["0,4"], method="pld")
    [full] = engine.generate(["abcabcabc"], SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop = full.text[3:5]
    pieces = []
    [cut] = engine.generate(
        ["abcabcabc"],
        SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop]),
        on_text=lambda i, text: pieces.append(text),
    )
    assert cut.text == full.text[: full.text.index(stop)]
    assert "".join(pieces) == cut.text


@pytest.mark.parametrize("fbs", [None, 4])
def test_compute_context_buckets_keep_greedy_output(model, tmp_path, reference, fbs):
    """Buckets 16/32 (+64 = ctx_len): each call runs in the smallest bucket holding its rows after the call.

    Rows cross 16 and 32 mid-draft; outputs still equal `none` and transformers greedy.
    """
    config = make_config(
        num_speculative_tokens="0,4",
        prefill_seq_len=8,
        ctx_len=CTX,
        full_batch_size=fbs,
        comp_ctx_lengths_prefill="16",
        comp_ctx_lengths_decode="16,32",
    )
    package, _, _ = compile_package(model, CompileOptions(specialization=config), output=tmp_path / "ccl")
    budgets = [30, 25, 20, 10, 28]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets]
    for method in ("none", "pld"):
        # cover: the K of each step, and so which bucket the last steps reach, must not depend on call
        # timings (auto's cost dispatch prices Ks by measured calls).
        engine = Engine(package, method=method, dispatch="cover")
        calls, run, prefill, phase = [], engine.model.run, engine.prefill, {"prefill": False}
        prefill_specs = set(engine.model.prefill_specs.values())

        def spy(bound, calls=calls, run=run, phase=phase, prefill_specs=prefill_specs):  # this method's engine
            live = bound.position_ids[bound.position_ids >= 0]
            # the prefill shape (a prompt's tail may run in a decode shape; a decode call carrying a prompt's
            # chunk is as wide as the prefill shape, in a decode bucket)
            shape = bound.spec in prefill_specs
            calls.append((phase["prefill"], shape, bound.spec.comp_ctx_lengths, int(live.min()), int(live.max())))
            return run(bound)

        def prefill_spy(group, prefill=prefill, phase=phase):
            phase["prefill"] = True
            try:
                return prefill(group)
            finally:
                phase["prefill"] = False

        engine.model.run, engine.prefill = spy, prefill_spy
        outputs = engine.generate(PROMPTS, params)
        for prompt, n, out in zip(PROMPTS, budgets, outputs):
            assert out.token_ids == reference(prompt, n)
        decode = [c[1:] for c in calls if not c[0]]
        for _, prefill_shape, ccl, _, last in calls:
            buckets = [16, 64] if prefill_shape else [16, 32, 64]
            assert ccl == min(b for b in buckets if b > last), (prefill_shape, ccl, last)
        # One row at a time reaches every bucket; with 4 rows the 30-token prompt keeps the batch above 16.
        assert {ccl for _, ccl, _, _ in decode} == ({16, 32, 64} if fbs is None else {32, 64})
        if method == "pld" and fbs is None:
            assert any(first < 16 <= last for _, _, first, last in decode), "a draft must cross a bucket edge"


def test_auto_dispatch_costs_greedy_steps_on_live_token_graphs(packages):
    """`auto` is `cost` for greedy steps on a graph that runs live tokens only (one fp32 slot included:
    a K=8 call there costs 1.5x a K=0 call) and with several slots; `cover` on a one-slot graph that
    pads every row to K + 1 (its drafts are free up to the K it runs), or when one samples."""
    from qspec.runtime.load import load_model

    one_slot = Engine(packages["0,4"], method="pld").dispatcher  # fp32, one slot: rows trimmed to live tokens
    assert one_slot.mode == "auto"
    assert one_slot.step_mode(greedy=True) == "cost" and one_slot.step_mode(greedy=False) == "cover"
    padded = load_model(packages["0,4"], vendor_graph=True)  # model.onnx pads in every format
    assert not padded.packs_live_tokens
    assert Engine(packages["0,4"], method="pld", model=padded).dispatcher.mode == "cover"
    engine = Engine(packages["cb"], method="pld")
    assert engine.model.packs_live_tokens and engine.dispatcher.mode == "auto"
    assert engine.dispatcher.step_mode(greedy=True) == "cost"  # the last request alone still pays every slot
    assert engine.dispatcher.step_mode(greedy=False) == "cover"  # seeded sampling must not depend on timings
    with pytest.raises(ConfigError, match="dispatch 'fast': use auto, cover, cost"):
        Engine(packages["0,4"], dispatch="fast")


@pytest.mark.parametrize("kind", ["0,4", "cb"])
def test_prompt_tail_through_decode_shapes_keeps_greedy_output(packages, reference, kind):
    """On a graph that pads (the vendor graph, as the qaic backend runs it) a prompt's last tokens run
    through decode shapes when those calls are timed cheaper (the plan of
    qspec.runtime.prefill.chunk_shape), through the prefill shape when not: the same greedy output. The
    runtime graph runs live tokens only: its tails stay in the prefill shape whatever the timings."""
    from qspec.runtime.model import CompiledModel
    from qspec.runtime.prefill import chunk_shape

    runtime = Engine(packages[kind], method="none").model
    assert runtime.packs_live_tokens and not runtime.call_ms  # warm-up times nothing it would not use
    runtime.call_ms = {runtime.prefill.spec: 100.0, **{b.spec: 1.0 for b in runtime.decode.values()}}
    assert chunk_shape(runtime, 1, 2) is None  # even where decode calls look cheaper
    outputs, calls = {}, {}
    for plan in ("decode tail", "prefill only"):
        engine = Engine(packages[kind], method="pld", model=CompiledModel(packages[kind], vendor_graph=True))
        model = engine.model
        if plan == "prefill only":
            model.call_ms = {}
        else:  # a decode call at 1 ms, the prefill shape at 100: a tail of t tokens runs ceil(t / 5) K=4 calls
            model.call_ms = {model.prefill.spec: 100.0, **{b.spec: 1.0 for b in model.decode.values()}}
            assert chunk_shape(model, 1, 7) == 4 and chunk_shape(model, 1, 8) is None  # 8 = prefill_seq_len
        before = engine.calls["prefill"]
        out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
        outputs[plan] = [o.token_ids for o in out]
        calls[plan] = engine.calls["prefill"] - before
    assert outputs["decode tail"] == outputs["prefill only"] == [reference(p, 12) for p in PROMPTS]
    # prompts of 10, 8, 15, 30, 5 tokens, prefill_seq_len 8: tails of 2, 0, 7, 6, 5 tokens
    assert calls["decode tail"] > calls["prefill only"]


def test_chunk_shape_picks_the_cheapest_way_to_finish(packages):
    """Measured call times decide: the prefill shape for a full chunk or when decode calls add up to more."""
    from qspec.runtime.model import CompiledModel
    from qspec.runtime.prefill import chunk_shape

    model = CompiledModel(packages["0,1,2,4,8"], vendor_graph=True)  # prefill 8; decode seq_len 1, 2, 3, 5, 9
    model.call_ms = {model.prefill.spec: 10.0, **{b.spec: 2.0 + b.spec.seq_len for b in model.decode.values()}}
    assert chunk_shape(model, 1, 8) is None  # a full chunk
    assert chunk_shape(model, 1, 1) == 0  # 3 ms
    assert chunk_shape(model, 1, 3) == 2  # one seq_len 3 call: 5 ms
    assert chunk_shape(model, 1, 4) == 4  # one seq_len 5 call: 7 ms (two seq_len 2 calls: 8)
    assert chunk_shape(model, 1, 7) is None  # 10 ms; two seq_len 5 calls: 14
    model.call_ms = {}
    assert chunk_shape(model, 1, 1) is None  # untimed: the prefill shape


def test_text_stream_decodes_incrementally_to_the_whole_text(tmp_path):
    """Fed a token at a time, multi-byte characters split across tokens included, the stream's pieces
    add up to the decoded output, and no piece holds half a character."""
    from qspec.runtime.tokenizer import TextStream, Tokenizer
    from tests.conftest import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    text = "héllo wörld, 你好 🙂 end\n  two  spaces"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # byte tokens: the multi-byte characters span several
    stream = TextStream(tokenizer)
    pieces = [stream.push([token]) for token in ids]
    assert "".join(pieces) == stream.text == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces) and pieces.count("") >= 6  # held back mid-character
    assert stream.push(ids[:3]) == "hé"  # several tokens at once: h and the two bytes of é
    assert stream.text == text + "hé"


def test_text_stream_text_is_the_decoded_ids_however_they_are_pushed(tmp_path):
    """Ids that end in half a character, with stray continuation bytes before: the stream's text after
    :meth:`flush` is ``decode(ids)`` for every split of the ids into pushes (a speculative step pushes
    several tokens, a plain one one). Without the flush a split that ended on U+FFFD lost the tail."""
    from qspec.runtime.tokenizer import TextStream, Tokenizer
    from tests.conftest import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    stray = tokenizer.encode("ű", add_special_tokens=False)[1]  # a continuation byte alone: U+FFFD for good
    lead = tokenizer.encode("你", add_special_tokens=False)[0]  # a character's first byte, its rest never comes
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = [*encode("a*"), stray, stray, stray, *encode("ű"), lead]
    for split in ([1] * len(ids), [len(ids)], [2, 4, 2], [3, 1, 3, 1], [5, 3]):
        stream, at, pieces = TextStream(tokenizer), 0, []
        for size in split:
            pieces.append(stream.push(ids[at : at + size]))
            at += size
        pieces.append(stream.flush())
        assert "".join(pieces) == stream.text == tokenizer.decode(ids) == "a*\ufffd\ufffd\ufffdű\ufffd", split


def test_package_run_with_another_prefill_chunk_size(packages, reference):
    """A package's runtime graph takes any seq_len: loaded with prefill_seq_len 3 or 16 (the package's is 8),
    it prefills in chunks of that size (more or fewer calls) and generates the same greedy tokens, on one KV
    slot and on four; a size the package cannot take is a one-line error."""
    from qspec.runtime.model import CompiledModel

    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for kind in ("0,4", "cb"):
        calls = {}
        for size in (3, 8, 16):
            model = CompiledModel(packages[kind], prefill_seq_len=size)
            assert model.prefill.spec.seq_len == size
            engine = Engine(packages[kind], method="pld", model=model)
            outputs = engine.generate(PROMPTS, params)
            assert [o.token_ids for o in outputs] == [reference(p, 12) for p in PROMPTS]
            calls[size] = engine.last_metrics.calls["prefill"]
        assert calls[3] > calls[8] > calls[16]
    with pytest.raises(ConfigError, match=f"prefill_seq_len 500 > ctx_len {CTX}"):
        CompiledModel(packages["0,4"], prefill_seq_len=500)


def test_a_package_without_drafts_runs_a_lone_query_token(model, packages, reference, tmp_path):
    """Compiled with K=0 only, no verify call's rounding is to be matched: a one-token call's attention runs
    its token alone (no zero token, no Pad/Slice per layer, as ONNX Runtime GenAI runs it). Its greedy output
    is transformers', and a K>0 package keeps the pad."""
    import onnx

    from qspec.package import LONE_QUERY, ORT_ONNX_FILE, read_manifest

    lone = compile_tiny(model, tmp_path / "k0", "0")

    def ops(package) -> list[str]:
        return [node.op_type for node in onnx.load(str(package / ORT_ONNX_FILE), load_external_data=False).graph.node]

    layers = read_manifest(lone).model.num_layers
    assert read_manifest(lone).runtime_graph.fusions.get(LONE_QUERY) == 1
    assert LONE_QUERY not in read_manifest(packages["0,4"]).runtime_graph.fusions
    # one per layer: the pad (a tree graph's q/k/v scattered to their op slots and gathered back)
    assert ops(packages["0,4"]).count("ScatterND") - ops(lone).count("ScatterND") == layers + 1  # and the positions
    assert ops(packages["0,4"]).count("GatherND") - ops(lone).count("GatherND") == layers
    plain, _ = run(lone, PROMPTS, method="none")
    for prompt, tokens in zip(PROMPTS, plain):
        assert tokens == reference(prompt, 20)
