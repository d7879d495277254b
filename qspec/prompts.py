"""Prompt files: MT-bench's ``question.jsonl`` (shipped with qspec) or any JSONL of prompts.

One line per prompt: an MT-bench object (``{"question_id", "category", "turns": [...]}``), an
OpenAI-style conversation (``{"messages": [{"role": "user", "content": ...}, ...]}``), an object with
a ``"prompt"`` or ``"text"`` string, or a bare JSON string. ``qspec bench`` reads every turn
(:func:`load_prompts`); ``qspec generate`` a conversation whole and of a record with turns the first
one (:func:`read_generate_prompts`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qspec.errors import ConfigError

MT_BENCH_FILE = Path("shared") / "data" / "mt_bench" / "question.jsonl"
SHIPPED_MT_BENCH = Path(__file__).resolve().parent / "data" / "mt_bench" / "question.jsonl"
DEFAULT_CATEGORY = "all"


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a file: its turns (MT-bench has two) and its category."""

    id: str
    category: str
    turns: tuple[str, ...]
    messages: tuple[dict[str, str], ...] = ()  # a "messages" line: the whole conversation


def _messages(item: Any, number: int, path: Path) -> tuple[dict[str, str], ...]:
    """The ``messages`` of a line: a non-empty list of ``{"role", "content"}`` strings."""
    messages = item["messages"]
    ok = isinstance(messages, list) and messages
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )
    if not ok:
        raise ConfigError(f'{path}:{number}: "messages" must be a list of {{"role": ..., "content": ...}} strings')
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def default_prompts_path() -> Path:
    """MT-bench's ``question.jsonl``: ``$QSPEC_MT_BENCH``, ``../shared/data`` of the project, or the shipped copy."""
    env = os.environ.get("QSPEC_MT_BENCH")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd().parent / MT_BENCH_FILE, Path(__file__).resolve().parents[2] / MT_BENCH_FILE]
    candidates.append(SHIPPED_MT_BENCH)
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(
        f"MT-bench questions not found (looked for {', '.join(str(p) for p in candidates)}); "
        "give --prompts FILE.jsonl or set QSPEC_MT_BENCH"
    )


def _prompt_from_line(item: Any, number: int, path: Path) -> PromptRecord:
    if isinstance(item, str):
        return PromptRecord(str(number), DEFAULT_CATEGORY, (item,))
    if not isinstance(item, dict):
        raise ConfigError(f'{path}:{number}: expected a JSON object with "turns", "messages" or "prompt"')
    ident = str(item.get("question_id", item.get("id", number)))
    category = str(item.get("category") or DEFAULT_CATEGORY)
    if "messages" in item:
        messages = _messages(item, number, path)
        users = tuple(m["content"] for m in messages if m["role"] == "user") or (messages[-1]["content"],)
        return PromptRecord(ident, category, users, messages)
    turns = item.get("turns")
    if turns is None:
        turns = [item.get("prompt") or item.get("text")]
    if not turns or not all(isinstance(t, str) and t for t in turns):
        raise ConfigError(f'{path}:{number}: no "turns" list of strings, "messages", "prompt" or "text" string')
    return PromptRecord(ident, category, tuple(turns))


def load_prompts(path: str | os.PathLike[str], *, per_category: int | None = None) -> list[PromptRecord]:
    """Prompts of a JSONL file (MT-bench lines, or ``{"prompt": ...}``); the first ``per_category`` of each."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist")
    prompts: list[PromptRecord] = []
    taken: Counter = Counter()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompt = _prompt_from_line(json.loads(line), number, path)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg}); one JSON object per line") from None
        if per_category is None or taken[prompt.category] < per_category:
            taken[prompt.category] += 1
            prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"prompts file {path} has no prompts")
    return prompts


def read_prompt_texts(path: str | os.PathLike[str]) -> list[str]:
    """The first turn of every prompt of a JSONL file, in order."""
    return [prompt.turns[0] for prompt in load_prompts(path)]


def read_generate_prompts(path: str | os.PathLike[str]) -> tuple[list[str | list[dict[str, str]]], int]:
    """``(prompts, multi_turn)``: what ``qspec generate`` runs for each line, in order (a conversation's
    messages, else the first turn), and how many records have turns it does not run (MT-bench's second
    turns need the answer to the first: ``qspec bench`` runs them)."""
    records = load_prompts(path)
    prompts = [list(r.messages) if r.messages else r.turns[0] for r in records]
    return prompts, sum(len(r.turns) > 1 and not r.messages for r in records)
