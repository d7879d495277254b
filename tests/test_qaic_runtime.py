"""The ``qaic`` runtime backend against a stand-in QAIC session (tests/fake_qaic_runtime) enforcing the session's rules.

The stand-in runs the network on ONNX Runtime but behaves as the device does: a call runs only with
buffers shaped like one compiled specialization, the retained-state KV stays on the "device", and a
skipped buffer is never read back. The engine on it must give the ORT backend's tokens exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from qspec.compile import CompileOptions, compile_package
from qspec.runtime import Engine, SamplingParams
from qspec.runtime.load import load_model
from qspec.runtime.qaic_session import QaicRuntimeError
from qspec.specializations import make_config

TESTS = Path(__file__).parent
PROMPTS = ["abcabcabcabc", "hello hello hello", "xyz"]


@pytest.fixture(scope="module")
def packages(tiny_model, tmp_path_factory):
    """Two packages compiled for qaic by the stand-in compiler: batch 1, K 0,4; continuous batching, K 0,2, with
    more KV slots (3) than decode rows (2): QEfficient's kv_cache_batch_size."""
    root = tmp_path_factory.mktemp("qaic-runtime")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QAIC_COMPILE", str(TESTS / "fake_qaic" / "qaic-compile"))
        built = {}
        for name, ks, fbs, kv in (("b1", "0,4", None, None), ("cb", "0,2", 2, 3)):
            spec = make_config(
                num_speculative_tokens=ks, ctx_len=64, prefill_seq_len=8, full_batch_size=fbs, kv_cache_batch_size=kv
            )
            options = CompileOptions.create(specialization=spec, backend="qaic")
            built[name], manifest, _ = compile_package(tiny_model("llama"), options, output=root / name)
            assert manifest.qaic.ran
    return built


def _forget_qefficient(monkeypatch) -> None:
    for name in [m for m in sys.modules if m == "QEfficient" or m.startswith("QEfficient.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def qaic_runtime(monkeypatch):
    """The stand-in QEfficient on sys.path for one test (imported afresh, forgotten after)."""
    monkeypatch.syspath_prepend(str(TESTS / "fake_qaic_runtime"))
    _forget_qefficient(monkeypatch)
    yield
    for name in [m for m in sys.modules if m == "QEfficient" or m.startswith("QEfficient.")]:
        del sys.modules[name]


def tokens(package, backend: str, method: str) -> list[list[int]]:
    engine = Engine(package, method=method, backend=backend)
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("name", ["b1", "cb"])
def test_engine_on_qaic_gives_the_ort_tokens(packages, qaic_runtime, name):
    """Greedy pld and none on the QAIC session equal plain greedy on ONNX Runtime, token for token (on "cb" three
    prompts in 3 KV slots, 2 a call: the vendor graph's padding rows point at the slot no live row writes)."""
    reference = tokens(packages[name], "ort", "none")
    assert tokens(packages[name], "qaic", "none") == reference
    assert tokens(packages[name], "qaic", "pld") == reference


def test_kv_cache_batch_size_in_the_vendor_files(packages):
    """The qaic package's specializations.json is QEfficient's for full_batch_size 2, kv_cache_batch_size 3:
    decode rows 2, the full_batch_size symbol 3 in every shape; the compile script passes that file."""
    import json

    specs = json.loads((packages["cb"] / "specializations.json").read_text())["specializations"]
    assert [(s["batch_size"], s["seq_len"], s["full_batch_size"]) for s in specs] == [
        ("1", "8", "3"),
        ("2", "1", "3"),
        ("2", "3", "3"),
    ]
    argv = json.loads((packages["cb"] / "qpc" / "fake_qaic_argv.json").read_text())
    assert "-network-specialization-config=specializations.json" in argv["argv"]


def test_kv_is_skipped_and_never_read_back(packages, qaic_runtime):
    """The model skips every past_* buffer; the session refuses to hand one back."""
    model = load_model(packages["b1"], backend="qaic")
    bound = model.decode[4]
    bound.reset()
    bound.input_ids[0, 0], bound.position_ids[0, 0] = 5, 0
    model.run(bound)
    outputs = model.session.run(
        {
            "input_ids": bound.input_ids,
            "position_ids": bound.position_ids,
            "num_logits_to_keep": np.zeros((5, 1), dtype=np.int64),
        }
    )
    assert set(model.kv_names) <= model.session._skipped
    with pytest.raises(KeyError, match="stays on the device"):
        outputs["past_key.0_RetainedState"]


def test_shapes_must_match_a_compiled_specialization(packages, qaic_runtime):
    """A call whose buffers match no specialization (seq_len 3 was not compiled) fails, listing the allowed shapes."""
    model = load_model(packages["b1"], backend="qaic")
    with pytest.raises(ValueError, match="no compiled specialization matches"):
        model.session.run(
            {
                "input_ids": np.zeros((1, 3), dtype=np.int64),
                "position_ids": np.zeros((1, 3), dtype=np.int64),
                "num_logits_to_keep": np.zeros((3, 1), dtype=np.int64),
                "logits": np.zeros((1, 3, 320), np.float32),
            }
        )


def test_missing_runtime_is_one_line(packages, monkeypatch):
    """Without the vendor's Python runtime, loading on qaic says what to install (no traceback chain)."""
    _forget_qefficient(monkeypatch)
    monkeypatch.setitem(sys.modules, "QEfficient", None)  # not importable
    with pytest.raises(QaicRuntimeError, match="not importable.*backend ort") as info:
        load_model(packages["b1"], backend="qaic")
    assert "\n" not in str(info.value)


def test_ort_package_has_no_qpc(tiny_model, tmp_path, qaic_runtime):
    """A package compiled for ort cannot run on qaic: the error says how to compile one."""
    spec = make_config(num_speculative_tokens="0", ctx_len=64, prefill_seq_len=8)
    folder, _, _ = compile_package(
        tiny_model("llama"), CompileOptions.create(specialization=spec), output=tmp_path / "p"
    )
    with pytest.raises(QaicRuntimeError, match="compiled for ort.*--backend qaic"):
        load_model(folder, backend="qaic")


def test_ccl_package_under_qaic_rules(tiny_model, tmp_path, monkeypatch, qaic_runtime):
    """A qaic package with CCL follows qaic-compile's rules (prefill bucket moved below ctx_len, said in the
    manifest's warnings); it gives the ORT tokens, and a prompt past its largest prefill bucket is refused
    instead of being attended to in part."""
    from qspec.errors import PromptTooLongError

    monkeypatch.setenv("QAIC_COMPILE", str(TESTS / "fake_qaic" / "qaic-compile"))
    spec = make_config(num_speculative_tokens="0,4", ctx_len=64, prefill_seq_len=8, comp_ctx_lengths_decode="32")
    options = CompileOptions.create(specialization=spec, backend="qaic")
    package, manifest, _ = compile_package(tiny_model("llama"), options, output=tmp_path / "ccl")
    assert manifest.config.ccl_rule == "qefficient"
    assert manifest.config.buckets("prefill") == [32] and manifest.config.buckets("decode") == [64]
    assert "comp_ctx_lengths_prefill 64 moved to 32" in " ".join(manifest.warnings)
    assert tokens(package, "qaic", "pld") == tokens(package, "ort", "none")
    engine = Engine(package, method="none", backend="qaic")
    with pytest.raises(PromptTooLongError, match="passes the largest prefill bucket 32"):
        engine.generate(["x" * 40], SamplingParams(max_new_tokens=2))
