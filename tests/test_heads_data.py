"""Training data of a draft head: instruction prompts of every kind and teacher-forced code records."""

from __future__ import annotations

from qspec.heads.data import code_records, instruction_prompts
from qspec.heads.prompts import KINDS


def test_instruction_prompts_are_every_kind_in_turn_and_a_prefix_of_a_longer_list():
    """Eight kinds in turn, deterministic for a seed, and the first n of a longer list (a stopped run resumes)."""
    short, long = instruction_prompts(16, seed=3), instruction_prompts(40, seed=3)
    assert short == long[:16] and short != instruction_prompts(16, seed=4)
    assert len(KINDS) == 8 and all(p[0]["role"] == "user" and p[0]["content"] for p in long)
    assert len({p[0]["content"] for p in long}) == 40
    assert "function" in long[4][0]["content"] or "program" in long[4][0]["content"] or "SQL" in long[4][0]["content"]


def test_code_records_teacher_force_standard_library_functions(tmp_path):
    """Each record is one chat, a request naming a function and its source as the answer, all prompt ids."""
    from tests.conftest import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    from qspec.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(tmp_path)
    records = code_records(5, tokenizer, max_tokens=4000)
    assert len(records) == 5 and all(not r["answer_ids"] for r in records)
    text = tokenizer.decode(records[0]["prompt_ids"])
    assert "Write a Python function `" in text and "```python\ndef " in text


def test_training_logs_the_chain_accuracy_of_each_eval_set(tiny_model, tmp_path):
    """``train_head(evals=...)`` logs every epoch's chain accuracy on each named features file beside the
    held-out one: on the training file itself it is the accuracy of the same positions the head trained on.
    The resumable state goes to ``state_dir``, made when missing."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from qspec.heads.train import TrainOptions, train_head

    target = AutoModelForCausalLM.from_pretrained(tiny_model("llama"))
    rng = np.random.default_rng(0)
    lengths = [24] * 12
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(0, 16, starts[-1]).astype(np.int64)  # few distinct tokens: something to learn
    features = rng.standard_normal((starts[-1], target.config.hidden_size)).astype(np.float16)
    path = tmp_path / "features-train.npz"
    np.savez(path, features=features, tokens=tokens, starts=starts, answer_starts=starts[:-1] + 4)
    options = TrainOptions(method="eagle", draft_vocab=16, epochs=2, batch_sequences=4, held_out=0.2, threads=1)
    state = tmp_path / "not-yet" / "state"  # made by the first epoch's checkpoint
    log = train_head([path], target, tmp_path / "head", options, state_dir=state, evals={"probe": [path]})
    assert [sorted(e["chain_accuracy"]) for e in log["epochs"]] == [["probe"], ["probe"]]
    assert (state / "train_state-eagle.pt").is_file()
    accuracy = log["epochs"][-1]["chain_accuracy"]["probe"]
    assert len(accuracy) == 3 and 1 >= accuracy[0] >= accuracy[1] >= accuracy[2] >= 0


def test_source_features_are_the_packages_hidden_states_of_the_source_answers(tiny_model, tmp_path):
    """``--features-from source``: one pass of the source model writes each answer (its greedy text) and the
    final-norm features of prompt and answer, equal to the fp32 package's hidden states of the same tokens (to fp16
    rounding); the labels are the greedy next token at every position; a stopped run resumes from its shards."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from qspec.compile import CompileOptions, compile_package
    from qspec.heads.data import hidden_rows
    from qspec.heads.distill import DistillOptions, _answered
    from qspec.runtime.load import load_model
    from qspec.specializations import make_config

    folder = tiny_model("llama", tie=False)
    spec = make_config(num_speculative_tokens="0", prefill_seq_len=64, ctx_len=1024)
    options = CompileOptions(specialization=spec, hidden_states=True)
    package, _, _ = compile_package(folder, options, output=tmp_path / "p")
    source = AutoModelForCausalLM.from_pretrained(folder).eval()
    data = DistillOptions.create(answer_with="source", features_from="source", max_new_tokens=12)
    prompts = instruction_prompts(5, seed=1)
    paths = _answered(package, source, prompts, tmp_path / "work", "answers", data, print)
    assert [p.name for p in paths] == ["features-final-answers-00000.npz"]
    features = np.load(paths[0])
    greedy = np.load(paths[0].with_suffix(".greedy.npy"))
    starts, answers, tokens = features["starts"], features["answer_starts"], features["tokens"]
    assert len(starts) == 6 and len(greedy) == len(tokens) == len(features["features"]) == starts[-1]
    model = load_model(package, num_threads=1)
    for lo, hi, answer in zip(starts[:-1], starts[1:], answers):
        sequence = tokens[lo:hi].tolist()
        assert hi - answer >= 1  # an answer, its last token dropped (nothing ran on it)
        expected = hidden_rows(model, sequence).astype(np.float32)
        np.testing.assert_allclose(features["features"][lo:hi].astype(np.float32), expected, atol=2e-2, rtol=2e-2)
        assert greedy[answer - 1 : hi - 1].tolist() == tokens[answer:hi].tolist()  # the model's greedy text
    logits = source.get_output_embeddings()(torch.from_numpy(features["features"].astype(np.float32)))
    assert (logits.argmax(-1).numpy() == greedy).mean() > 0.99  # prompt positions too (fp16 features: near ties)
    assert _answered(package, source, prompts, tmp_path / "work", "answers", data, print) == paths  # resumes


def test_source_features_need_source_answers():
    import pytest

    from qspec.errors import ConfigError
    from qspec.heads.distill import DistillOptions

    with pytest.raises(ConfigError, match="--answer-with source"):
        DistillOptions.create(features_from="source")
