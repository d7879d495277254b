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
    held-out one: on the training file itself it is the accuracy of the same positions the head trained on."""
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
    log = train_head([path], target, tmp_path / "head", options, evals={"probe": [path]})
    assert [sorted(e["chain_accuracy"]) for e in log["epochs"]] == [["probe"], ["probe"]]
    accuracy = log["epochs"][-1]["chain_accuracy"]["probe"]
    assert len(accuracy) == 3 and 1 >= accuracy[0] >= accuracy[1] >= accuracy[2] >= 0
