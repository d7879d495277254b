"""EAGLE-3 data phases: Magpie requests and answers, the MT-bench guard, teacher taps, resumable shards."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qspec.heads import eagle3_data, magpie  # noqa: E402


def tokenizer_of(folder):
    from qspec.runtime.tokenizer import Tokenizer

    return Tokenizer(folder)


def mt_bench_questions() -> list[str]:
    from qspec.heads.eagle3_distill import mt_bench_first_turns

    return [chat[0]["content"] for chat in mt_bench_first_turns()]


def test_mt_bench_text_is_refused_and_other_text_kept():
    guard = magpie.mt_bench_guard()
    questions = mt_bench_questions()
    assert len(questions) == 80
    assert not any(magpie.keep_training_text(q, guard) for q in questions)
    assert not magpie.keep_training_text("Please: " + questions[0].upper() + " Thanks!", guard)
    assert magpie.keep_training_text("Write a short poem about the sea at night.", guard)


class ScriptedModel:
    """Stands in for a model's ``generate``: returns the prefix followed by scripted token rows."""

    def __init__(self, rows):
        self.rows = rows

    def generate(self, input_ids, **kwargs):
        width = max(map(len, self.rows))
        tail = torch.tensor([r + [2] * (width - len(r)) for r in self.rows])
        return torch.cat((input_ids[: len(self.rows)], tail), 1)


def test_magpie_requests_drop_mt_bench_repeats_and_unfinished(tiny_model, tmp_path):
    """The sampled requests keep their order and lose MT-bench quotes, repeats and cut-off rows."""
    tokenizer = tokenizer_of(tiny_model("llama"))
    good = "How do I keep basil alive on a windowsill?"
    quote = mt_bench_questions()[3]
    rows = [tokenizer.encode(text, add_special_tokens=False) + [2] for text in (good, quote, good)]
    rows.append(tokenizer.encode("never ends", add_special_tokens=False))
    out = tmp_path / "requests.jsonl"
    got = magpie.write_requests(ScriptedModel(rows), tokenizer, 1, out, stop_ids=[2], batch=4)
    assert [r["prompt"] for r in got] == [good]
    assert magpie.read_jsonl(out) == got
    assert magpie.request_prefix(tokenizer) == tokenizer.encode("<s>user: ", add_special_tokens=False)


def test_answers_skip_mt_bench_prompts_and_resume(tiny_model, tmp_path):
    """MT-bench prompts are not answered into training files; a second run answers only what is missing."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model("llama")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), tokenizer_of(folder)
    prompts = [[{"role": "user", "content": text}] for text in ("hello there", mt_bench_questions()[0], "tell me")]
    out = tmp_path / "answers.jsonl"
    first = magpie.write_answers(model, tokenizer, prompts[:1], out, stop_ids=[2], max_new_tokens=4, batch=1)
    again = magpie.write_answers(model, tokenizer, prompts, out, stop_ids=[2], max_new_tokens=4, batch=1)
    assert len(first) == 1 and len(again) == 2 and again[0] == first[0]
    texts = [tokenizer.decode(r["prompt_ids"]) for r in again]
    assert "Hawaii" not in "".join(texts) and "tell me" in texts[1]
    direct = model.generate(torch.tensor([again[1]["prompt_ids"]]), max_new_tokens=4, do_sample=False)
    assert again[1]["answer_ids"] == direct[0, len(again[1]["prompt_ids"]) :].tolist()[: len(again[1]["answer_ids"])]


def test_teacher_taps_are_the_residual_stream_entering_the_layers(tiny_model, tmp_path):
    """Tap i = output_hidden_states[i]; labels = the target's argmax; shards resume one by one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama", layers=6)).eval()
    assert eagle3_data.default_taps(30) == (2, 15, 27) and eagle3_data.default_taps(6) == (2, 3, 3)
    records = [{"prompt_ids": [1, 5, 9, 13], "answer_ids": [20, 21]}, {"prompt_ids": [1, 7], "answer_ids": [8, 9, 2]}]
    records += [{"prompt_ids": [1, 3, 4], "answer_ids": [6]}]
    paths = eagle3_data.write_teacher_shards(model, records, tmp_path, "t", taps=(2, 3, 3), shard=2, batch=2)
    assert [p.name for p in paths] == ["t-00000.npz", "t-00001.npz"]
    data = eagle3_data.load_shards(paths)
    for i, r in enumerate(records):
        seq = r["prompt_ids"] + r["answer_ids"]
        with torch.no_grad():
            out = model(torch.tensor([seq]), output_hidden_states=True)
        rec = eagle3_data.record(data, i)
        want = torch.stack([out.hidden_states[t][0] for t in (2, 3, 3)], 1).half().numpy()
        assert np.allclose(rec["taps"].astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-2)
        assert rec["labels"].tolist() == out.logits[0].argmax(-1).tolist()
        assert rec["answer"] == len(r["prompt_ids"]) and rec["tokens"].tolist() == seq
    stamp = paths[0].stat().st_mtime_ns
    paths[1].unlink()
    again = eagle3_data.write_teacher_shards(model, records, tmp_path, "t", taps=(2, 3, 3), shard=2, batch=2)
    assert again == paths and paths[1].is_file() and paths[0].stat().st_mtime_ns == stamp


def test_training_resumes_to_the_same_head(tiny_model, tmp_path):
    """A run stopped after a saved batch and started again ends with the weights of an unbroken run."""
    from transformers import AutoModelForCausalLM

    from qspec.heads import eagle3_model, eagle3_train

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama", layers=6)).eval()
    rng = np.random.default_rng(0)
    records = [
        {"prompt_ids": rng.integers(3, 300, 5).tolist(), "answer_ids": rng.integers(3, 300, 12).tolist()}
        for _ in range(12)
    ]
    data = eagle3_data.load_shards(eagle3_data.write_teacher_shards(model, records, tmp_path, "t", taps=(2, 3, 3)))
    options = eagle3_train.Eagle3Options(
        steps=2, draft_vocab=64, epochs=2, batch_tokens=40, held_out=2, save_every=1, max_tokens=32
    )

    def factory(ids):
        return eagle3_model.head_from_target(model, torch.from_numpy(ids), (2, 3, 3))

    (tmp_path / "a").mkdir()
    whole, log = eagle3_train.train(factory, data, tmp_path / "a", options)

    class Stop(Exception):
        pass

    def stop_at_batch_3(message):
        if message.startswith("curve") and "'batches': 3," in message:  # a learning-curve point at batch 3
            raise Stop

    (tmp_path / "b").mkdir()
    options_b = options.model_copy(update={"eval_every": 3})
    with pytest.raises(Stop):
        eagle3_train.train(factory, data, tmp_path / "b", options_b, progress=stop_at_batch_3)
    resumed, log_b = eagle3_train.train(factory, data, tmp_path / "b", options_b)
    assert log_b["curve"][0]["batches"] == 3 and log_b["curve"][-1]["batches"] == log["curve"][-1]["batches"]
    assert log_b["tokens"] == log["tokens"]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
