"""Prompt files: every line form gives its first turn; bad lines name the file and line."""

from __future__ import annotations

import json

import pytest

from qspec.errors import ConfigError
from qspec.prompts import load_prompts, read_prompt_texts


def test_every_line_form_gives_its_first_turn(tmp_path):
    """MT-bench turns, "prompt", "text" and a bare string, in file order; blank lines skipped."""
    path = tmp_path / "p.jsonl"
    lines = [{"turns": ["a", "a2"], "category": "c"}, {"prompt": "b"}, {"text": "c"}, "d"]
    path.write_text(
        "\n".join(json.dumps(line) for line in lines[:2]) + "\n\n" + "\n".join(json.dumps(x) for x in lines[2:])
    )
    assert read_prompt_texts(path) == ["a", "b", "c", "d"]
    assert load_prompts(path)[0].turns == ("a", "a2")


def test_bad_line_is_named(tmp_path):
    """A line that is not JSON, or has no prompt, is a ConfigError naming file:line."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(ConfigError, match="p.jsonl:2"):
        read_prompt_texts(path)
    path.write_text('{"prompt": 3}\n')
    with pytest.raises(ConfigError, match="p.jsonl:1"):
        read_prompt_texts(path)


def test_messages_lines_are_whole_conversations(tmp_path):
    """An OpenAI-style {"messages": [...]} line is one chat prompt; records with several turns are counted."""
    from qspec.prompts import read_generate_prompts

    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [{"messages": chat}, {"turns": ["a", "b"]}, "c"]))
    prompts, multi_turn = read_generate_prompts(path)
    assert prompts == [chat, "a", "c"] and multi_turn == 1
    assert load_prompts(path)[0].turns == ("hi", "again")
    path.write_text(json.dumps({"messages": [{"role": "user"}]}))
    with pytest.raises(ConfigError, match='p.jsonl:1: "messages" must be'):
        read_generate_prompts(path)
