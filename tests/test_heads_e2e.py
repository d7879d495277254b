"""Draft heads end to end on a tiny model: train one from the package (``qspec train-head``), compile it into the
package (``--draft-head``), and decode with it: greedy output equals ``none`` of the same package, drafts are
proposed and some accepted, at batch 1 and 4, fp32 and int4, EAGLE and Medusa."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from qspec.compile import CompileOptions, compile_package
from qspec.errors import ConfigError
from qspec.runtime import Engine, SamplingParams
from qspec.specializations import make_config

CTX = 96
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    list(range(30, 60)),
    [40, 41, 40, 41, 40],
    [100, 17, 3, 99, 250, 18],
]
EAGLE_KS = "0,1,2,4"


def compile_tiny(model, folder, *, ks=EAGLE_KS, fbs=None, weight_format="fp32", **options):
    spec = make_config(num_speculative_tokens=ks, prefill_seq_len=8, ctx_len=CTX, full_batch_size=fbs)
    package, _, _ = compile_package(
        model, CompileOptions(specialization=spec, weight_format=weight_format, **options), output=folder
    )
    return package


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    """An EAGLE and a Medusa head trained by `qspec train-head` on a tiny package's own greedy answers."""
    from qspec_cli.main import app

    root = tmp_path_factory.mktemp("heads")
    package = compile_tiny(model, root / "hs", hidden_states=True)
    out = {}
    for method in ("eagle", "medusa"):
        args = ["train-head", str(package), "--output", str(root / method), "--method", method]
        args += ["--prompts", "24", "--dialogues", "8", "--max-new-tokens", "40", "--epochs", "6"]
        args += ["--draft-vocab", "200", "--lr", "3e-3", "--json"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        out[method] = (root / method, json.loads(result.output[result.output.index("{") :]))
    return out


def run(package, prompts, *, n=24, **engine_options):
    engine = Engine(package, **engine_options)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outputs], engine


def test_training_writes_the_layouts_and_learns(heads):
    """The trained heads are in their checkpoint layouts, and held-out first-draft accuracy beats chance."""
    eagle_dir, eagle_log = heads["eagle"]
    medusa_dir, medusa_log = heads["medusa"]
    assert (eagle_dir / "config.json").is_file() and (eagle_dir / "model.safetensors").is_file()
    assert (medusa_dir / "config.json").is_file()
    assert len(eagle_log["epochs"]) == 6 and eagle_log["epochs"][-1]["held_out_chain_accuracy"][0] > 0.2
    assert medusa_log["epochs"][-1]["held_out_chain_accuracy"][0] > 0.2


@pytest.mark.parametrize("method", ["eagle", "medusa", "eagle+pld"])
@pytest.mark.parametrize("weight_format", ["fp32", "int4"])
def test_head_greedy_equals_none(model, heads, tmp_path, method, weight_format):
    """Greedy output with the head equals `none` of the same package, with drafts accepted (cover and cost)."""
    head = heads[method.removesuffix("+pld")][0]
    package = compile_tiny(model, tmp_path / "p", weight_format=weight_format, draft_head=str(head))
    plain, _ = run(package, PROMPTS, method="none")
    for dispatch in ("cover", "auto"):
        spec, engine = run(package, PROMPTS, method=method, dispatch=dispatch)
        assert spec == plain, dispatch
    covered = run(package, PROMPTS, method=method, dispatch="cover")[1].last_metrics
    assert covered.proposed > 0 and covered.accepted > 0


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_head_continuous_batching_equals_batch_one(model, heads, tmp_path, method):
    """Four KV slots, six requests (admitted mid-batch): every output equals `none` at batch 1."""
    head = heads[method][0]
    package = compile_tiny(model, tmp_path / "cb", fbs=4, draft_head=str(head))
    prompts = PROMPTS + [[7, 7, 8, 9, 10], list(range(60, 75))]
    plain, _ = run(package, prompts, method="none", max_batch_size=1)
    spec, engine = run(package, prompts, method=method, dispatch="cover")
    assert spec == plain
    assert engine.last_metrics.accepted > 0


def test_head_sampling_is_reproducible(model, heads, tmp_path):
    """A seeded sampled request gives the same tokens twice with the head."""
    package = compile_tiny(model, tmp_path / "p", draft_head=str(heads["eagle"][0]))
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    first = Engine(package, method="eagle").generate(PROMPTS[:2], params)
    second = Engine(package, method="eagle").generate(PROMPTS[:2], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_head_method_without_a_head_is_a_clear_error(model, tmp_path):
    """--method eagle on a package without a head says how to compile one in."""
    package = compile_tiny(model, tmp_path / "plain", ks="0,4")
    with pytest.raises(ConfigError, match="--draft-head"):
        Engine(package, method="eagle")
