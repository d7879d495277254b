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
