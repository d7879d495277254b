"""Draft heads end to end on a tiny model: train one from the package (``qspec train-head``), compile it into the
package (``--draft-head``), and decode with it: greedy output equals ``none`` of the same package, drafts are
proposed and some accepted, at batch 1 and 4, fp32 and int4, EAGLE and Medusa.

A random tiny model's greedy text is a random function of its whole context: nothing a head could learn from a
few hundred tokens. The target here has its attention and MLP outputs zeroed (``o_proj``, ``down_proj``), so its
next greedy token depends on the current token only (a random map over the vocabulary): a head learns that map
in seconds, and its drafts are accepted often enough to exercise every acceptance path."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from qspec.compile import CompileOptions, compile_package
from qspec.errors import ConfigError
from qspec.runtime import Engine, SamplingParams
from qspec.specializations import make_config

CTX = 256
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


def markov_model(folder):
    """Write a tiny untied Llama whose layers add nothing to the residual stream (next token = g(current token))
    to ``folder``; returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import byte_tokenizer, tiny_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config("llama", tie=False))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() > 1:
                param.normal_(0, 0.3)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
    hf.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny untied Llama whose next greedy token depends on the current token only (:func:`markov_model`)."""
    return markov_model(tmp_path_factory.mktemp("markov"))


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    """An EAGLE and a Medusa head trained by `qspec train-head` on a tiny package's own greedy answers."""
    from qspec_cli.main import app

    root = tmp_path_factory.mktemp("heads")
    package = compile_tiny(model, root / "hs", hidden_states=True)
    # A random tiny model writes no usable request of its own: the Magpie phase resumes from requests an earlier
    # sitting wrote (the file the phase appends to), answers them and takes the package's features of the answers.
    generated = root / "work" / "generated"
    generated.mkdir(parents=True)
    requests = [f"Write {n} short sentences about the sea." for n in range(2, 10)]
    lines = [json.dumps({"prompt": text, "batch": 0}) for text in requests]
    (generated / "requests-magpie.jsonl").write_text("\n".join(lines) + "\n")
    out = {}
    for method in ("eagle", "medusa"):
        args = ["train-head", str(package), "--output", str(root / method), "--method", method]
        args += ["--prompts", "40", "--dialogues", "40", "--max-new-tokens", "40", "--epochs", "8"]
        args += ["--draft-vocab", "320", "--lr", "3e-3", "--work-dir", str(root / "work"), "--json"]
        if method == "medusa":  # the other data phases: instructions answered by the source model, code
            args += ["--instructions", "16", "--answer-with", "source", "--code", "8", "--eval-mt-bench", "0"]
        else:  # requests the model writes itself (Magpie) and MT-bench answers for the learning curve
            args += ["--magpie", "8", "--eval-mt-bench", "2"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        out[method] = (root / method, json.loads(result.output[result.output.index("{") :]))
    return out


@pytest.fixture(scope="module")
def head_package(model, heads, tmp_path_factory):
    """Factory: ``head_package(head, weight_format, fbs)`` -> a package with that trained head, compiled once."""
    root = tmp_path_factory.mktemp("head-packages")
    made = {}

    def make(head: str, weight_format: str = "fp32", fbs: int | None = None):
        key = (head, weight_format, fbs)
        if key not in made:
            folder = root / f"{head}-{weight_format}-{fbs}"
            made[key] = compile_tiny(
                model, folder, fbs=fbs, weight_format=weight_format, draft_head=str(heads[head][0])
            )
        return made[key]

    return make


def run(package, prompts, *, n=24, **engine_options):
    engine = Engine(package, **engine_options)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outputs], engine


def test_every_data_phase_leaves_its_files(heads):
    """Answers of both sources and the teacher-forced phases each leave their records and features."""
    work = heads["eagle"][0].parent / "work"
    instructions = [json.loads(line) for line in (work / "answers-instructions.jsonl").read_text().splitlines()]
    assert len(instructions) == 16 and all(r["answer_ids"] for r in instructions)
    for name in ("answers", "answers-instructions", "code", "dialogues", "teacher-magpie-00000"):
        assert (work / f"features-{name}.npz").is_file()
    magpie = np.load(work / "features-teacher-magpie-00000.npz")
    requests = (work / "generated" / "requests-magpie.jsonl").read_text().splitlines()
    assert len(magpie["starts"]) - 1 == len(requests) == 8  # each request answered
    assert magpie["features"].shape[0] == magpie["starts"][-1]
    assert (work / "eval" / "features-teacher-mtbench-00000.npz").is_file()


def test_training_writes_the_layouts_and_learns(heads):
    """The trained heads are in their checkpoint layouts, and held-out first-draft accuracy beats chance."""
    eagle_dir, eagle_log = heads["eagle"]
    medusa_dir, medusa_log = heads["medusa"]
    assert (eagle_dir / "config.json").is_file() and (eagle_dir / "model.safetensors").is_file()
    assert (medusa_dir / "config.json").is_file()
    assert len(eagle_log["epochs"]) == 8 and eagle_log["epochs"][-1]["held_out_chain_accuracy"][0] > 0.2
    assert all(len(e["chain_accuracy"]["mt_bench"]) == 3 for e in eagle_log["epochs"])  # the MT-bench curve
    assert "chain_accuracy" not in medusa_log["epochs"][-1]  # --eval-mt-bench 0
    assert medusa_log["epochs"][-1]["held_out_chain_accuracy"][0] > 0.2


@pytest.mark.parametrize("method", ["eagle", "medusa", "eagle+pld"])
@pytest.mark.parametrize("weight_format", ["fp32", "int4"])
def test_head_greedy_equals_none(head_package, method, weight_format):
    """Greedy output with the head equals `none` of the same package, with drafts accepted (cover and cost)."""
    package = head_package(method.removesuffix("+pld"), weight_format)
    plain, _ = run(package, PROMPTS, method="none")
    for dispatch in ("cover", "auto"):
        spec, engine = run(package, PROMPTS, method=method, dispatch=dispatch)
        assert spec == plain, dispatch
    covered = run(package, PROMPTS, method=method, dispatch="cover")[1].last_metrics
    assert covered.proposed > 0 and covered.accepted > 0


@pytest.mark.parametrize(("method", "weight_format"), [("eagle", "fp32"), ("eagle", "int4"), ("medusa", "fp32")])
def test_head_continuous_batching_equals_batch_one(head_package, method, weight_format):
    """Four KV slots, six requests (admitted mid-batch): every output equals `none` at batch 1, under `cover` and
    under `auto` (each row priced by its own survival, chains cut by what a head call costs, drafting that does
    not pay turned off per row)."""
    package = head_package(method, weight_format, fbs=4)
    prompts = PROMPTS + [[7, 7, 8, 9, 10], list(range(60, 75))]
    plain, _ = run(package, prompts, method="none", max_batch_size=1)
    for dispatch in ("cover", "auto"):
        spec, engine = run(package, prompts, method=method, dispatch=dispatch)
        assert spec == plain, dispatch
        assert engine.last_metrics.accepted > 0, dispatch


def test_head_sampling_is_reproducible(head_package):
    """A seeded sampled request gives the same tokens twice with the head."""
    package = head_package("eagle")
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    first = Engine(package, method="eagle").generate(PROMPTS[:2], params)
    second = Engine(package, method="eagle").generate(PROMPTS[:2], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_head_method_without_a_head_is_a_clear_error(model, tmp_path):
    """--method eagle on a package without a head says how to compile one in."""
    package = compile_tiny(model, tmp_path / "plain", ks="0,4")
    with pytest.raises(ConfigError, match="--draft-head"):
        Engine(package, method="eagle")


def test_cli_draft_confidence_threshold(head_package, tmp_path):
    """`qspec generate --draft-confidence-threshold`: a higher threshold proposes fewer drafts, the output
    stays `none`'s; out of [0, 1] it is refused; serve passes it to head methods only."""
    from qspec_cli.main import app
    from qspec_cli.serve import method_options

    package = head_package("eagle")
    prompts = tmp_path / "prompts.jsonl"
    texts = ["the cat sat on the mat and the cat", "one two three four one two"]
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))

    def generate(*extra: str) -> dict:
        args = ["generate", str(package), "--prompts-file", str(prompts), "--max-new-tokens", "16", "--json", *extra]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        return json.loads(result.output[result.output.index("{") :])

    plain = generate("--method", "none")
    loose, strict = (generate("--method", "eagle", "--draft-confidence-threshold", t) for t in ("0", "0.9"))
    tokens = [[r["token_ids"] for r in doc["requests"]] for doc in (plain, loose, strict)]
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]
    assert strict["metrics"]["proposed"] < loose["metrics"]["proposed"]
    refused = CliRunner().invoke(app, ["generate", str(package), "-p", "x", "--draft-confidence-threshold", "1.5"])
    assert refused.exit_code == 2 and "--draft-confidence-threshold" in refused.output
    knobs = dict(prompt_lookup_min=1, prompt_lookup_max=3, draft_package=None, draft_confidence_threshold=0.3)
    assert method_options("eagle+pld", **knobs)["draft_confidence_threshold"] == 0.3
    assert "draft_confidence_threshold" not in method_options("pld", **knobs)
