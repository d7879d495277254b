"""``qspec train-head PACKAGE --method eagle3``: the data phases and the training of an EAGLE-3 head.

::

    chat template ──► requests-magpie.jsonl ──┐  (the target writes requests, :mod:`qspec.heads.magpie`)
    chit-chat prompts, instructions ──────────┼─► teacher-NAME-*.npz ──► train ──► head
                                              │   (greedy answers + their 3 taps and labels, one batched
                                              │    KV-cached pass: :mod:`qspec.heads.eagle3_generate`)
    MT-bench first turns (evaluation only) ───┴─► eval/teacher-mtbench-*.npz

Everything runs on the source model in torch (the checkpoint or GGUF the package was compiled from, as
its manifest records, or ``model``): taps come from ``output_hidden_states``, as SpecForge computes them.
Every phase writes files into ``work_dir`` and skips what is there, so a long run spans several sittings;
training resumes from ``train/state.pt``. MT-bench answers live in ``eval/`` and never reach training.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from qspec.common import FrozenModel
from qspec.errors import ConfigError
from qspec.heads.eagle3_train import Eagle3Options

Progress = Callable[[str], None]


class Eagle3DataOptions(FrozenModel):
    """What an EAGLE-3 head is distilled from."""

    magpie: int = Field(default=1200, ge=0)  # requests the target writes itself, then answers
    prompts: int = Field(default=400, ge=0)  # chit-chat dialogue prompts (chitchat-dataset)
    instructions: int = Field(default=400, ge=0)  # instructions of eight kinds (qspec.heads.prompts)
    dialogues: int = Field(default=0, ge=0)  # chit-chat dialogues teacher-forced (no generation: one forward)
    max_new_tokens: int = Field(default=160, ge=1)
    batch: int = Field(default=32, ge=1)  # prompts per batched generation
    taps: tuple[int, int, int] | None = None  # default (2, L // 2, L - 3)
    eval_mt_bench: int = Field(default=16, ge=0, le=80)  # MT-bench first turns answered into eval/ (never trained)
    seed: int = 0


def source_of(package: Path, model: str | None) -> str:
    """The model to load: ``model``, else the source the package's manifest records."""
    if model:
        return model
    from qspec.package import check_package

    source = check_package(package).model.source
    if not source:
        raise ConfigError(f"{package}'s manifest records no source model; give --model CHECKPOINT_OR_GGUF")
    return source


class HFChat:
    """A Hugging Face tokenizer with the package tokenizer's methods (``render_chat``, ``encode``, ...)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stop_ids(self, eos_token_ids) -> frozenset[int]:
        own = self.tokenizer.eos_token_id
        return frozenset(eos_token_ids) | ({own} if own is not None else frozenset())


def chat_tokenizer(package: Path, hf_tokenizer):
    """The package's tokenizer (what the runtime renders chats with), else the source model's."""
    from qspec.runtime.tokenizer import Tokenizer

    if (package / "tokenizer" / "tokenizer.json").is_file():
        return Tokenizer(package / "tokenizer")
    return HFChat(hf_tokenizer)


@contextlib.contextmanager
def _timed(times: dict, name: str):
    """Adds the wall time of the block to ``times[name]`` (seconds, summed over sittings)."""
    begin = time.perf_counter()
    yield
    times[name] = round(times.get(name, 0.0) + time.perf_counter() - begin, 1)


def data_phases(model, tokenizer, work: Path, options: Eagle3DataOptions, say: Progress) -> dict:
    """Requests, answers and teacher shards in ``work``: ``{"train": [shards], "mtbench": [shards], "times"}``."""
    from qspec.heads.data import chat_prompts, instruction_prompts
    from qspec.heads.eagle3_data import check_taps, default_taps, write_teacher_shards
    from qspec.heads.eagle3_generate import write_generated_shards
    from qspec.heads.magpie import encode_prompts, write_requests

    layers = model.config.num_hidden_layers
    taps = check_taps(options.taps or default_taps(layers), layers)
    stop = sorted(tokenizer.stop_ids([model.config.eos_token_id] if model.config.eos_token_id is not None else []))
    work.mkdir(parents=True, exist_ok=True)
    times_path = work / "times.json"
    times = json.loads(times_path.read_text()) if times_path.is_file() else {}
    sources: dict[str, list[list[dict]]] = {}
    if options.prompts:
        sources["chat"] = chat_prompts(options.prompts, seed=options.seed)
    if options.instructions:
        sources["instructions"] = instruction_prompts(options.instructions, seed=options.seed)
    shards: dict[str, list[Path]] = {"train": [], "mtbench": []}
    answer = dict(taps=taps, stop_ids=stop, max_new_tokens=options.max_new_tokens, batch=options.batch, progress=say)
    if options.eval_mt_bench:
        (work / "eval").mkdir(exist_ok=True)
        with _timed(times, "eval"):
            chats = mt_bench_first_turns()[:: 80 // options.eval_mt_bench][: options.eval_mt_bench]
            shards["mtbench"] = write_generated_shards(
                model, encode_prompts(tokenizer, chats, screen=False), work / "eval", "teacher-mtbench", **answer
            )
    if options.magpie:
        with _timed(times, "requests"):
            path, batch = work / "requests-magpie.jsonl", max(options.batch, 16)
            requests = write_requests(
                model, tokenizer, options.magpie, path, stop_ids=stop, seed=options.seed, batch=batch, progress=say
            )
        sources = {"magpie": [[{"role": "user", "content": r["prompt"]}] for r in requests]} | sources
    for name, prompts in sources.items():
        with _timed(times, "answers"):
            encoded = encode_prompts(tokenizer, prompts)
            shards["train"] += write_generated_shards(model, encoded, work, f"teacher-{name}", **answer)
        times_path.write_text(json.dumps(times, indent=2) + "\n")
    if options.dialogues:
        with _timed(times, "teacher"):
            records = dialogue_records(options.dialogues, tokenizer, skip=options.seed * options.dialogues)
            shards["train"] += write_teacher_shards(model, records, work, "teacher-dialogues", taps=taps, progress=say)
    times_path.write_text(json.dumps(times, indent=2) + "\n")
    return shards | {"times": times, "taps": taps}


def dialogue_records(count: int, tokenizer, *, max_tokens: int = 512, skip: int = 0) -> list[dict]:
    """``count`` chit-chat dialogues (speakers as user and assistant) through the chat template, to teacher-force:
    the first user turn is the prompt, the rest the answer (its labels are the target's own greedy tokens).
    Dialogues ``skip ..`` in the corpus's order; MT-bench-quoting ones are dropped."""
    from qspec.heads.data import _turns, chitchat_dialogues
    from qspec.heads.magpie import mt_bench_guard, screen_prompts

    guard, records = mt_bench_guard(), []
    for dialogue in list(chitchat_dialogues().values())[skip : skip + count]:
        turns = [t for t in _turns(dialogue) if t]
        messages = [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(turns)]
        if len(messages) < 2 or not screen_prompts([messages], guard):
            continue
        prompt = tokenizer.encode(tokenizer.render_chat(messages[:1]), add_special_tokens=False)
        whole = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=False), add_special_tokens=False)
        if whole[: len(prompt)] == prompt:
            records.append({"prompt_ids": prompt, "answer_ids": whole[len(prompt) : max_tokens]})
    return records


def mt_bench_first_turns() -> list[list[dict]]:
    """MT-bench's 80 first turns as chats: evaluation data, answered into ``eval/`` only."""
    path = Path(__file__).resolve().parents[1] / "data" / "mt_bench" / "question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": row["turns"][0]}] for row in rows]


def distill_eagle3(
    package: Path,
    output: Path,
    *,
    work_dir: Path,
    data: Eagle3DataOptions,
    train: Eagle3Options,
    model: str | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
) -> dict:
    """All phases; the head in ``output`` (``config.json``, ``model.safetensors``) and its log (returned and
    written to ``work_dir/train/log.json``)."""
    import torch

    from qspec.export.loader import load_model, resolve_source
    from qspec.heads import eagle3_model, eagle3_train
    from qspec.heads.eagle3_data import load_shards

    say = progress or (lambda message: None)
    if threads:
        torch.set_num_threads(threads)
    source = source_of(package, model)
    say(f"loading the source model {source}")
    target, hf_tokenizer = load_model(resolve_source(source))
    target.eval()
    tokenizer = chat_tokenizer(package, hf_tokenizer)
    shards = data_phases(target, tokenizer, work_dir, data, say)
    train_data = load_shards(shards["train"])
    evals = {}
    if shards["mtbench"]:
        mt_bench = load_shards(shards["mtbench"])
        evals["mt_bench"] = (mt_bench, list(range(len(mt_bench["starts"]) - 1)))
    (work_dir / "train").mkdir(exist_ok=True)
    head, log = eagle3_train.train(
        lambda ids: eagle3_model.head_from_target(target, torch.from_numpy(ids), shards["taps"], init=train.init),
        train_data,
        work_dir / "train",
        train,
        evals=evals,
        progress=say,
    )
    eagle3_model.save_head(head, output)
    log |= {"data_seconds": shards["times"], "train_positions": int(train_data["starts"][-1])}
    (work_dir / "train" / "log.json").write_text(json.dumps(log, indent=2) + "\n")
    return log
