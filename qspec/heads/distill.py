"""``qspec train-head``: self-distill a draft head from the package it will serve, one resumable phase at a time.

::

    chit-chat prompts ──► answers.jsonl ──────────────┐
    instructions ──► answers-instructions.jsonl ──────┤ (the package's greedy answers)
    code (standard-library functions, teacher-forced) ┤
    dialogues (teacher-forced chit-chat) ─────────────┼─► features-*.npz ──► train ──► head folder
    Magpie requests the model writes, answered ───────┘   (the package's hidden states)
    MT-bench first turns, answered ──► eval/features-*.npz (evaluation only: the learning curve)

The Magpie requests and the MT-bench answers come from the EAGLE-3 data phases
(:func:`qspec.heads.eagle3_distill.data_phases`: the source model in torch, batched and KV-cached).

Every phase writes its output into ``work_dir`` and is skipped when that output is there, so a stopped
run resumes; training resumes from its last epoch. The package must have the ``hidden_states`` output
(``qspec compile --hidden-states``); the head trains on the features of that package's weight format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

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
    # whose hidden states the head learns from: the package's of the answers (its weight format, a second pass)
    # or the source model's, read off the forwards that wrote the answers (one pass; needs answer_with source)
    features_from: Literal["package", "source"] = "package"
    magpie: int = Field(default=0, ge=0)  # requests the model writes itself (Magpie), answered by the source model
    eval_mt_bench: int = Field(default=0, ge=0, le=80)  # MT-bench first turns answered into eval/ (never trained)
    seed: int = 0

    @model_validator(mode="after")
    def _source_features_need_source_answers(self) -> DistillOptions:
        if self.features_from == "source" and self.answer_with != "source":
            raise ValueError("features_from source reads the source model's forwards: give --answer-with source too")
        return self


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
        features += _answered(package, model, prompts, work_dir, "answers", data, say)
    if data.instructions:
        prompts = instruction_prompts(data.instructions, seed=data.seed)
        features += _answered(package, model, prompts, work_dir, "answers-instructions", data, say)
    tokenizer = Tokenizer(package / "tokenizer")
    if data.code:
        records = code_records(data.code, tokenizer, seed=data.seed)
        features.append(_features(package, records, work_dir / "features-code.npz", say))
    if data.dialogues:
        records = dialogue_records(data.dialogues, tokenizer, skip=data.seed * data.dialogues)
        features.append(_features(package, records, work_dir / "features-dialogues.npz", say))
    mt_bench: list[Path] = []
    if data.magpie or data.eval_mt_bench:
        magpie, mt_bench = _generated(package, model, tokenizer, work_dir, data, say)
        features += magpie
    if not features:
        raise ConfigError("no training data: give --prompts, --instructions, --magpie, --code or --dialogues above 0")
    from qspec.heads.train import train_head

    evals = {"mt_bench": mt_bench} if mt_bench else None
    return train_head(features, model, output, train, state_dir=work_dir, progress=say, evals=evals)


def _generated(
    package: Path, model, tokenizer, work_dir: Path, data: DistillOptions, say: Progress
) -> tuple[list[Path], list[Path]]:
    """(training, evaluation) features files: Magpie requests and MT-bench first turns answered by the source model
    (the EAGLE-3 data phases' shards, in ``work_dir/generated``), then the package's features of those tokens."""
    from qspec.heads.eagle3_distill import Eagle3DataOptions, data_phases

    options = Eagle3DataOptions(  # the shards' taps go unused: an EAGLE-1 head reads the package's final-norm features
        taps=(0, 0, 0),
        magpie=data.magpie,
        prompts=0,
        instructions=0,
        max_new_tokens=data.max_new_tokens,
        eval_mt_bench=data.eval_mt_bench,
        seed=data.seed,
    )
    shards = data_phases(model, tokenizer, work_dir / "generated", options, say)
    train = [_shard_features(package, shard, work_dir / f"features-{shard.stem}.npz", say) for shard in shards["train"]]
    evals = [
        _shard_features(package, shard, work_dir / "eval" / f"features-{shard.stem}.npz", say)
        for shard in shards["mtbench"]
    ]
    return train, evals


def _shard_features(package: Path, shard: Path, path: Path, say: Progress) -> Path:
    """The package's features of a teacher shard's records (their prompt and answer tokens)."""
    import numpy as np

    if path.is_file():
        return path
    data = np.load(shard)
    tokens, starts, answers = data["tokens"].tolist(), data["starts"].tolist(), data["answer_starts"].tolist()
    records = [
        {"prompt_ids": tokens[lo:answer], "answer_ids": tokens[answer:hi]}
        for lo, hi, answer in zip(starts[:-1], starts[1:], answers)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    return _features(package, records, path, say)


def _answered(
    package: Path, model, prompts: list, work_dir: Path, name: str, data: DistillOptions, say: Progress
) -> list[Path]:
    """Greedy answers to ``prompts`` (``NAME.jsonl``) and the package's features of them (``features-NAME.npz``);
    with ``features_from`` source, the source model's shards and features instead (:func:`_answered_with_features`)."""
    from qspec.heads.data import generate_answers, generate_answers_torch

    if data.features_from == "source":
        return _answered_with_features(model, package, prompts, work_dir, name, data, say)
    features = work_dir / f"features-{name}.npz"
    if features.is_file():
        return [features]
    answers, budget = work_dir / f"{name}.jsonl", data.max_new_tokens
    if data.answer_with == "source":
        say(f"answering {len(prompts)} prompts with the source model, batched")
        records = generate_answers_torch(model, package, prompts, answers, max_new_tokens=budget, progress=say)
    else:
        say(f"answering {len(prompts)} prompts with {package}")
        records = generate_answers(package, prompts, answers, max_new_tokens=budget, progress=say)
    return [_features(package, records, features, say)]


def _answered_with_features(
    model, package: Path, prompts: list, work_dir: Path, name: str, data: DistillOptions, say: Progress
) -> list[Path]:
    """The source model's greedy answers to ``prompts`` with its final-norm hidden states, one pass: shards
    ``generated/final-NAME-*.npz`` (64 prompts each, resumable), then ``features-final-NAME-*.npz``."""
    from qspec.heads.data import features_from_shard
    from qspec.heads.eagle3_generate import write_generated_shards
    from qspec.heads.magpie import encode_prompts
    from qspec.package import check_package
    from qspec.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(package / "tokenizer")
    stop = sorted(tokenizer.stop_ids(check_package(package).model.eos_token_ids))
    encoded = encode_prompts(tokenizer, prompts)
    say(f"answering {len(encoded)} prompts with the source model, batched, its features read off the same forwards")
    generated = work_dir / "generated"
    generated.mkdir(parents=True, exist_ok=True)
    shards = write_generated_shards(
        model,
        encoded,
        generated,
        f"final-{name}",
        taps=(model.config.num_hidden_layers,),  # hidden_states[L]: after the final norm, what the LM head reads
        stop_ids=stop,
        max_new_tokens=data.max_new_tokens,
        progress=say,
    )
    lm_head = model.get_output_embeddings()
    return [
        path if path.is_file() else features_from_shard(shard, path, lm_head)
        for shard, path in ((shard, work_dir / f"features-{shard.stem}.npz") for shard in shards)
    ]


def _features(package: Path, records: list[dict], path: Path, say: Progress) -> Path:
    from qspec.heads.data import collect_features

    if path.is_file():
        return path
    tmp = path.with_suffix(".tmp.npz")
    collect_features(package, records, tmp, progress=say)
    tmp.rename(path)
    return path
