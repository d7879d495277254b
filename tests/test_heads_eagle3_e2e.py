"""An EAGLE-3 head compiled into a real package (taps + folded fc) and decoded: greedy ``eagle`` (and its alias
``eagle3``) equals ``none`` token for token for K lists 0,4 and 0,1,2,4, at batch 1 and 4 (continuous
batching), fp32 and int4; and the qaic backend's vendor files (the stand-in compiler) for target and head.

The head is random (written under vLLM's names by the test), its draft vocabulary the target's most frequent
greedy tokens, so drafts are proposed at every step and some accepted: every acceptance path runs."""

from __future__ import annotations

import json
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from qspec.compile import CompileOptions, compile_package  # noqa: E402
from qspec.runtime import Engine, SamplingParams  # noqa: E402
from qspec.specializations import make_config  # noqa: E402
from tests.test_heads_eagle3 import write_eagle3_head  # noqa: E402
from tests.test_heads_export import fake_compiler  # noqa: E402, F401  (the stand-in qaic-compile on PATH)

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(30, 50)), [40, 41, 40, 41, 40], [100, 17, 3, 99, 250, 18]]
MORE = [[7, 7, 8, 9, 10], list(range(60, 75))]
NEW = 20
TAPS = [0, 1, 3]


@pytest.fixture(scope="module")
def target(tiny_model):
    """A 4-layer untied tiny target and the folder it is saved in."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model("llama", tie=False, layers=4)
    return folder, AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """A random EAGLE-3 head (vLLM's layout) whose draft vocabulary is the target's 3 most frequent greedy tokens."""
    folder, model = target
    counts = Counter()
    with torch.no_grad():
        for prompt in PROMPTS + MORE:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
            counts.update(out[0, len(prompt) :].tolist())
    frequent = [token for token, _ in counts.most_common(3)]
    return write_eagle3_head(
        tmp_path_factory.mktemp("eagle3") / "head", model.config, draft_ids=frequent, layer_ids=TAPS
    )


@pytest.fixture(scope="module")
def package(target, head, tmp_path_factory):
    """Factory: ``package(ks, weight_format, fbs)`` -> the target compiled with the EAGLE-3 head, once each."""
    root = tmp_path_factory.mktemp("eagle3-packages")
    made = {}

    def make(ks: str, weight_format: str, fbs: int | None):
        key = (ks, weight_format, fbs)
        if key not in made:
            spec = make_config(num_speculative_tokens=ks, prefill_seq_len=8, ctx_len=128, full_batch_size=fbs)
            options = CompileOptions(specialization=spec, weight_format=weight_format, draft_head=str(head))
            made[key] = compile_package(target[0], options, output=root / f"{ks}-{weight_format}-{fbs}")[0]
        return made[key]

    return make


def run(package, prompts, **engine_options):
    engine = Engine(package, **engine_options)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    return [o.token_ids for o in outputs], engine.last_metrics


@pytest.mark.parametrize(
    ("ks", "weight_format", "fbs"),
    [("0,4", "fp32", None), ("0,1,2,4", "fp32", 4), ("0,1,2,4", "int4", None), ("0,4", "int4", 4)],
)
def test_eagle3_greedy_equals_none(package, ks, weight_format, fbs):
    """Greedy `eagle` and `eagle3` equal `none` of the same package token for token (batch 4 under continuous
    batching with six requests admitted as slots free), with drafts proposed (and accepted at fp32)."""
    folder = package(ks, weight_format, fbs)
    prompts = PROMPTS + MORE if fbs else PROMPTS
    plain, _ = run(folder, prompts, method="none", max_batch_size=1)
    for method in ("eagle", "eagle3"):
        for dispatch in ("cover", "auto"):
            spec, metrics = run(folder, prompts, method=method, dispatch=dispatch)
            assert spec == plain, (method, dispatch)
    _, covered = run(folder, prompts, method="eagle", dispatch="cover")
    assert covered.proposed > 0
    # The head drafts the fp32 model's most frequent greedy tokens; an int4 package (its untied embedding block-
    # quantized too) writes others, so only fp32 is sure to accept drafts (int4 acceptance: test_weight_formats).
    assert covered.accepted > 0 or weight_format != "fp32"


def test_eagle3_package_records_its_kind(package, head):
    """The head manifest names the EAGLE-3 layout and the eagle method; the package exports hidden states."""
    from qspec.head_manifest import read_head_manifest
    from qspec.package import read_manifest

    folder = package("0,4", "fp32", None)
    info = read_head_manifest(folder)
    assert (info.layout, info.method, info.draft_vocab_size) == ("eagle3", "eagle", 3)
    assert read_manifest(folder).model.hidden_states


def test_qaic_vendor_files_hold_taps_fc_and_the_heads_program(target, head, tmp_path, fake_compiler):  # noqa: F811
    """backend qaic: model.onnx computes hidden_states from the taps with the head's fc, the target's custom IO
    keeps hidden_states in the KV precision; the head has its custom IO, per-K specializations and a compile
    command run by the stand-in compiler."""
    import onnx

    spec = make_config(num_speculative_tokens="0,1,4", prefill_seq_len=8, ctx_len=64)
    options = CompileOptions(specialization=spec, draft_head=str(head), backend="qaic")
    folder = compile_package(target[0], options, output=tmp_path / "pkg")[0]
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert [n.name for n in graph.node if n.name.startswith("taps.")] == ["taps.concat", "taps.fc"]
    assert next(n for n in graph.node if n.name == "taps.concat").input == ["tap.0", "tap.1", "tap.3"]
    assert [o.name for o in graph.output][:2] == ["logits", "hidden_states"]
    assert "IOName: hidden_states\n" in (folder / "custom_io.yaml").read_text()
    head_dir = folder / "head"
    custom_io = (head_dir / "custom_io.yaml").read_text()
    for name in ("past_key.0", "past_value.0_RetainedState", "hidden_states", "hidden_states_out"):
        assert f"IOName: {name}\n" in custom_io
    wire = json.loads((head_dir / "specializations.json").read_text())["specializations"]
    assert [int(entry["seq_len"]) for entry in wire] == [8, 1, 2, 5]  # prefill, chain, K + 1 for K = 1, 4
    script = (head_dir / "compile_qaic.sh").read_text()
    assert "head.onnx" in script and "custom_io.yaml" in script and "specializations.json" in script
    assert (head_dir / "qpc" / "programqpc.bin").is_file()
