"""Batched greedy answers with their EAGLE-3 teacher rows read off the same forwards (tiny random model)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qspec.heads.eagle3_data import load_shards, record, teacher_rows  # noqa: E402
from qspec.heads.eagle3_generate import greedy_with_taps, write_generated_shards  # noqa: E402

TAPS = (1, 2, 3)
PROMPTS = [[5, 17, 9], [3, 4, 5, 6, 7, 8, 9, 10], [200, 1], [44, 45, 46, 47, 48]]


def target(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("llama", layers=4)).double().eval()


def batch_one(model, prompt: list[int], stop: list[int], new: int) -> list[int]:
    out = model.generate(
        input_ids=torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=stop, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def test_batched_answers_equal_batch_one_greedy_and_rows_equal_a_teacher_forward(tiny_model):
    """Left-padded, early-finishing rows: answers equal batch-1 greedy (stop token kept), and every row but
    the last equals a teacher-forced forward of prompt + answer (taps to fp16 precision, answer labels
    exactly; inside the prompt the label is the prompt's next token)."""
    model = target(tiny_model)
    with torch.inference_mode():
        stop = [batch_one(model, PROMPTS[1], [0], 8)[2]]  # prompt 1 stops after 3 tokens
        want = [batch_one(model, p, stop, 8) for p in PROMPTS]
        got = greedy_with_taps(model, PROMPTS, TAPS, stop_ids=stop, max_new_tokens=8)
    assert len(got[1]["answer_ids"]) == 3 and got[1]["answer_ids"][-1] == stop[0]
    for rec, answer in zip(got, want):
        assert rec["answer_ids"] == answer
        seq = rec["prompt_ids"] + rec["answer_ids"]
        ((taps, labels),) = teacher_rows(model, [seq], TAPS)
        assert rec["taps"].shape == taps.shape and rec["taps"].dtype == np.float16
        np.testing.assert_allclose(rec["taps"][:-1], taps[:-1], atol=2e-3, rtol=2e-3)
        prompt = len(rec["prompt_ids"])
        assert np.array_equal(rec["labels"][prompt - 1 : -1], labels[prompt - 1 : -1])  # the answer's labels
        assert rec["labels"][: prompt - 1].tolist() == rec["prompt_ids"][1:]
        assert not rec["taps"][-1].any()


def test_generated_shards_resume_and_read_back_as_teacher_records(tiny_model, tmp_path):
    """Two shards of two prompts; a rerun keeps the written shard; records read back with their answers."""
    model = target(tiny_model)
    args = dict(taps=TAPS, stop_ids=[0], max_new_tokens=4, batch=2, shard=2)
    paths = write_generated_shards(model, PROMPTS, tmp_path, "teacher-x", **args)
    assert [p.name for p in paths] == ["teacher-x-00000.npz", "teacher-x-00001.npz"]
    stamp = paths[0].stat().st_mtime_ns
    paths[1].unlink()
    write_generated_shards(model, PROMPTS, tmp_path, "teacher-x", **args)
    assert paths[0].stat().st_mtime_ns == stamp and paths[1].is_file()
    data = load_shards(paths)
    for i, prompt in enumerate(PROMPTS):
        r = record(data, i)
        assert r["tokens"][: r["answer"]].tolist() == prompt
        assert np.array_equal(r["tokens"][r["answer"] + 1 :], r["labels"][r["answer"] : -1])  # greedy answers
