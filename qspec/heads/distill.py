"""``qspec train-head``: self-distill a draft head from the package it will serve, one resumable phase at a time.

::

    chit-chat prompts ──► answers.jsonl ──────────────┐
    instructions ──► answers-instructions.jsonl ──────┤ (the package's greedy answers)
    code (standard-library functions, teacher-forced) ┼─► features-*.npz ──► train ──► head folder
    dialogues (teacher-forced chit-chat) ─────────────┘   (the package's hidden states)

Every phase writes its output into ``work_dir`` and is skipped when that output is there, so a stopped
run resumes; training resumes from its last epoch. The package must have the ``hidden_states`` output
(``qspec compile --hidden-states``); the head trains on the features of that package's weight format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field

from qspec.common import FrozenModel
from qspec.errors import ConfigError
from qspec.heads.train import TrainOptions

Progress = Callable[[str], None]


class DistillOptions(FrozenModel):
    """What data a head is distilled from."""

    prompts: int = Field(default=1500, ge=0)  # chit-chat prompts the package answers (its own greedy output)
    instructions: int = Field(default=0, ge=0)  # instructions of eight kinds the package answers
    code: int = Field(default=0, ge=0)  # standard-library functions teacher-forced as answers to requests
    dialogues: int = Field(default=500, ge=0)  # whole dialogues teacher-forced through the package
    prompts_file: Path | None = None  # JSON lines of {"messages": [...]} or {"prompt": "..."}; default chit-chat
    max_new_tokens: int = Field(default=128, ge=1)
    # who writes the answers: the package (one slot, its exact greedy text) or the model it was compiled from
    # (batched in PyTorch, several times faster on the CPU; features and labels still come from the package)
    answer_with: Literal["package", "source"] = "package"
    seed: int = 0


def read_prompts_file(path: Path) -> list[list[dict]]:
    """Chat conversations from JSON lines: ``{"messages": [...]}`` or ``{"prompt": "..."}`` per line."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg}); give one JSON object per line") from None
        if isinstance(record, dict) and isinstance(record.get("messages"), list):
            prompts.append(record["messages"])
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append([{"role": "user", "content": record["prompt"]}])
        else:
            raise ConfigError(f'{path}:{number}: give {{"messages": [...]}} or {{"prompt": "..."}}')
    return prompts


def load_target(source: str):
    """The Hugging Face model a package was exported from (its embeddings and LM head feed the head)."""
    from qspec.export.loader import load_model, resolve_source

    model, _ = load_model(resolve_source(source))
    return model.eval()


def distill_head(
    package: Path,
    output: Path,
    *,
    work_dir: Path,
    data: DistillOptions,
    train: TrainOptions,
    target: str | None = None,
    progress: Progress | None = None,
) -> dict:
    """Answers, features, training: the head in ``output`` (EAGLE-1 or Medusa layout) and its training log."""
    from qspec.heads.data import chat_prompts, code_records, dialogue_records, instruction_prompts
    from qspec.package import check_package
    from qspec.runtime.tokenizer import Tokenizer

    say = progress or (lambda message: None)
    manifest = check_package(package)
    if not manifest.model.hidden_states:
        raise ConfigError(f"{package} has no hidden_states output; compile it with --hidden-states")
    work_dir.mkdir(parents=True, exist_ok=True)
    say(f"loading the target model {target or manifest.model.source}")  # it writes answers (source) and trains
    model = load_target(target or manifest.model.source)
    features = []
    if data.prompts:
        prompts = (
            read_prompts_file(data.prompts_file) if data.prompts_file else chat_prompts(data.prompts, seed=data.seed)
        )
        features.append(_answered(package, model, prompts, work_dir, "answers", data, say))
    if data.instructions:
        prompts = instruction_prompts(data.instructions, seed=data.seed)
        features.append(_answered(package, model, prompts, work_dir, "answers-instructions", data, say))
    tokenizer = Tokenizer(package / "tokenizer")
    if data.code:
        records = code_records(data.code, tokenizer, seed=data.seed)
        features.append(_features(package, records, work_dir / "features-code.npz", say))
    if data.dialogues:
        records = dialogue_records(data.dialogues, tokenizer, skip=data.seed * data.dialogues)
        features.append(_features(package, records, work_dir / "features-dialogues.npz", say))
    if not features:
        raise ConfigError("no training data: give --prompts, --instructions, --code or --dialogues above 0")
    from qspec.heads.train import train_head

    return train_head(features, model, output, train, state_dir=work_dir, progress=say)


def _answered(
    package: Path, model, prompts: list, work_dir: Path, name: str, data: DistillOptions, say: Progress
) -> Path:
    """Greedy answers to ``prompts`` (``NAME.jsonl``) and the package's features of them (``features-NAME.npz``)."""
    from qspec.heads.data import generate_answers, generate_answers_torch

    features = work_dir / f"features-{name}.npz"
    if features.is_file():
        return features
    answers, budget = work_dir / f"{name}.jsonl", data.max_new_tokens
    if data.answer_with == "source":
        say(f"answering {len(prompts)} prompts with the source model, batched")
        records = generate_answers_torch(model, package, prompts, answers, max_new_tokens=budget, progress=say)
    else:
        say(f"answering {len(prompts)} prompts with {package}")
        records = generate_answers(package, prompts, answers, max_new_tokens=budget, progress=say)
    return _features(package, records, features, say)


def _features(package: Path, records: list[dict], path: Path, say: Progress) -> Path:
    from qspec.heads.data import collect_features

    if path.is_file():
        return path
    tmp = path.with_suffix(".tmp.npz")
    collect_features(package, records, tmp, progress=say)
    tmp.rename(path)
    return path
