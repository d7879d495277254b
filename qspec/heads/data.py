"""Training data for a draft head, self-distilled from the package it will serve.

Two passes, each resumable:

1. ``generate_answers``: the package answers chat prompts greedily (its own output is what the head
   must predict); each record is ``{"prompt_ids": [...], "answer_ids": [...]}`` in a JSON-lines file.
2. ``collect_features``: every record runs through the package's prefill again, on a package compiled
   with the ``hidden_states`` output, and its final-norm hidden states are kept (fp16) beside the
   tokens: ``features [positions, hidden]``, ``tokens [positions]``, ``starts [records + 1]`` and
   ``answer_starts [records]`` (where each record's answer begins).

Prompts come from a dialogue corpus a PyPI package ships (``chitchat-dataset``, MIT: human chit-chat
dialogues) and from instruction templates over topics drawn from it; MT-bench is the evaluation set
and never enters here.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from qspec.errors import ConfigError

Progress = Callable[[str], None]

# Instructions of the kinds chat users ask; {topic} comes from the dialogues.
TEMPLATES = (
    "Write a short story about {topic}.",
    "Explain {topic} to a beginner.",
    "Give me three tips about {topic}.",
    "Write a poem about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a short email to a friend about {topic}.",
    "Summarize what you know about {topic} in a few sentences.",
    "Describe a day in the life of someone who loves {topic}.",
    "Write a persuasive paragraph about {topic}.",
    "List five questions people often ask about {topic}, with short answers.",
)


def chitchat_dialogues() -> dict:
    """The dialogues of the ``chitchat-dataset`` package (``pip install --no-deps chitchat-dataset``)."""
    import importlib.util

    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or spec.origin is None:
        raise ConfigError("the training prompts come from chitchat-dataset: pip install --no-deps chitchat-dataset")
    return json.loads((Path(spec.origin).parent / "dataset.json").read_text())


def _turns(dialogue: dict) -> list[str]:
    return [" ".join(m["text"].strip() for m in turn if m.get("text")) for turn in dialogue["messages"]]


def chat_prompts(count: int, *, seed: int = 0) -> list[list[dict]]:
    """``count`` chat conversations ending on a user turn: dialogue prefixes (up to 3 turns, the
    speakers as user and assistant) and instruction templates over a topic from a dialogue turn."""
    rng = random.Random(seed)
    dialogues = [_turns(d) for d in chitchat_dialogues().values()]
    dialogues = [d for d in dialogues if len(d) >= 2]
    rng.shuffle(dialogues)
    prompts = []
    for i in range(count):
        turns = dialogues[i % len(dialogues)]
        if i % 3 == 2:  # an instruction about something a dialogue talks about
            words = [w.strip(".,!?\"'").lower() for w in " ".join(turns).split()]
            words = [w for w in words if len(w) > 5 and w.isalpha()]
            topic = rng.choice(words) if words else "friendship"
            prompts.append([{"role": "user", "content": rng.choice(TEMPLATES).format(topic=topic)}])
            continue
        end = rng.randrange(len(turns)) // 2 * 2 + 1  # an odd number of turns: the last one is the user's
        end = min(end, 3 + (end % 2 == 0))
        messages = [
            {"role": "user" if j % 2 == 0 else "assistant", "content": text[:600]}
            for j, text in enumerate(turns[max(0, end - 3) : end])
        ]
        if messages[0]["role"] != "user":
            messages = messages[1:]
        prompts.append(messages)
    return prompts


def instruction_prompts(count: int, *, seed: int = 0) -> list[list[dict]]:
    """``count`` one-turn instructions of eight kinds (:mod:`qspec.heads.prompts`), their topics and quoted
    texts taken from the chit-chat dialogues."""
    from qspec.heads.prompts import instruction_prompt

    rng = random.Random(seed + 1)
    turns = [t for d in chitchat_dialogues().values() for t in _turns(d) if 20 <= len(t) <= 300]
    prompts = []
    for i in range(count):
        text = rng.choice(turns)
        words = [w.strip(".,!?\"'").lower() for w in text.split()]
        words = [w for w in words if len(w) > 5 and w.isalpha()] or ["friendship"]
        prompts.append([{"role": "user", "content": instruction_prompt(i, rng, rng.choice(words), text)}])
    return prompts


def code_records(count: int, tokenizer, *, max_tokens: int = 512, seed: int = 0) -> list[dict]:
    """``count`` chats to teacher-force: a request for a function of Python's standard library (its name,
    signature and the first line of its docstring) and the function's source as the answer."""
    import ast
    import sysconfig

    rng = random.Random(seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng.shuffle(files)
    records: list[dict] = []
    for path in files:
        try:
            source = path.read_text()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if not doc or node.name.startswith("_") or not 4 <= node.end_lineno - node.lineno <= 40:
                continue
            code = ast.get_source_segment(source, node)
            if code is None:
                continue
            ask = f"Write a Python function `{node.name}` that does this: {doc.splitlines()[0].strip()}"
            answer = f"Here is the function:\n\n```python\n{code}\n```"
            messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
            ids = tokenizer.encode_chat(messages)[:max_tokens]
            records.append({"prompt_ids": [int(t) for t in ids], "answer_ids": []})
            if len(records) == count:
                return records
    return records


def dialogue_records(count: int, tokenizer, *, max_tokens: int = 512, skip: int = 0) -> list[dict]:
    """``count`` whole chit-chat dialogues through the chat template (speakers as user and assistant), cut to
    ``max_tokens``: text to teacher-force (its labels are the target's own greedy predictions, computed
    from the hidden states at training time). Dialogues ``skip ..`` in the corpus's order."""
    records = []
    for dialogue in list(chitchat_dialogues().values())[skip : skip + count]:
        turns = [t for t in _turns(dialogue) if t]
        messages = [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(turns)]
        if not messages:
            continue
        ids = tokenizer.encode_chat(messages)[:max_tokens]
        records.append({"prompt_ids": [int(t) for t in ids], "answer_ids": []})
    return records


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def generate_answers(
    package: Path,
    prompts: list[list[dict]],
    output: Path,
    *,
    max_new_tokens: int = 128,
    batch: int = 16,
    num_threads: int | None = None,
    progress: Progress | None = None,
) -> list[dict]:
    """Greedy answers of ``package`` to ``prompts``, appended to ``output`` (JSON lines) a batch at a time;
    records already there are kept and their prompts skipped (a stopped run resumes)."""
    from qspec.runtime.config import EngineConfig
    from qspec.runtime.engine import Engine
    from qspec.runtime.sampling import SamplingParams

    say = progress or (lambda message: None)
    done = read_records(output)
    engine = Engine(package, EngineConfig.create(method="pld", num_threads=num_threads, spinning=num_threads is None))
    params = SamplingParams(max_new_tokens=max_new_tokens)
    lengths = [len(engine.tokenizer.encode_prompt(p, chat=True)) for p in prompts]
    prompts = _fitting(prompts, lengths, engine.model.ctx_len - max_new_tokens, say)
    with output.open("a") as sink:
        for at in range(len(done), len(prompts), batch):
            outs = engine.generate(prompts[at : at + batch], params, chat=True)
            records = [
                {"prompt_ids": list(map(int, out.prompt_token_ids)), "answer_ids": list(map(int, out.token_ids))}
                for out in outs
            ]
            _append(sink, done, records, len(prompts), say)
    return done


def _fitting(prompts: list, lengths: list[int], room: int, say: Progress) -> list:
    """The prompts of at most ``room`` tokens (a longer one could not be answered in full); says how many not."""
    fits = [p for p, n in zip(prompts, lengths) if n <= room]
    if len(fits) < len(prompts):
        say(f"{len(prompts) - len(fits)} of {len(prompts)} prompts are longer than {room} tokens: skipped")
    return fits


def _append(sink, done: list[dict], records: list[dict], total: int, say: Progress) -> None:
    """Write ``records`` to the answers file (flushed: a stopped run keeps them) and to ``done``."""
    for record in records:
        sink.write(json.dumps(record) + "\n")
        done.append(record)
    sink.flush()
    say(f"answers {len(done)}/{total}, {sum(len(r['answer_ids']) for r in done)} tokens")


def generate_answers_torch(
    model,
    package: Path,
    prompts: list[list[dict]],
    output: Path,
    *,
    max_new_tokens: int = 128,
    batch: int = 32,
    progress: Progress | None = None,
) -> list[dict]:
    """Greedy answers of the Hugging Face ``model`` the package was compiled from, ``batch`` prompts a call
    (left-padded): many times the package's one-slot rate on the CPU. The features and labels still come
    from the package (:func:`collect_features`); only the answer text is the source model's. Appends to
    ``output`` and resumes like :func:`generate_answers`."""
    import torch

    from qspec.package import check_package
    from qspec.runtime.tokenizer import Tokenizer

    say = progress or (lambda message: None)
    done = read_records(output)
    manifest = check_package(package)
    tokenizer = Tokenizer(package / "tokenizer")
    eos = sorted(tokenizer.stop_ids(manifest.model.eos_token_ids))
    encoded = [tokenizer.encode_chat(p) for p in prompts]
    encoded = _fitting(encoded, list(map(len, encoded)), manifest.specializations[0].ctx_len - max_new_tokens, say)
    with output.open("a") as sink, torch.inference_mode():
        for at in range(len(done), len(encoded), batch):
            chunk = encoded[at : at + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[eos[0]] * (width - len(c)) + c for c in chunk])
            mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
            records = [
                {
                    "prompt_ids": prompt_ids,
                    "answer_ids": next((row[: i + 1] for i, t in enumerate(row) if t in eos), row),
                }
                for prompt_ids, row in zip(chunk, out[:, width:].tolist())
            ]
            _append(sink, done, records, len(encoded), say)
    return done


def hidden_rows(model, sequence: list[int]) -> np.ndarray:
    """``[len(sequence), hidden]`` fp16: the final-norm hidden state of every token of ``sequence``, prefilled
    into slot 0 of ``model`` (a loaded package with the ``hidden_states`` output)."""
    from qspec.runtime.prefill import PrefillRow, run_prefill

    parts: list[np.ndarray] = []
    run_prefill(model, [PrefillRow(0, sequence)], lambda i, logits: None, lambda i, s, h: parts.append(h.copy()))
    return np.concatenate(parts).astype(np.float16)


def collect_features(
    package: Path,
    records: list[dict],
    output: Path,
    *,
    num_threads: int | None = None,
    progress: Progress | None = None,
) -> Path:
    """Hidden states of every record's prompt and answer from ``package`` (compiled with ``--hidden-states``),
    written to ``output`` (``.npz``)."""
    from qspec.runtime.load import load_model

    say = progress or (lambda message: None)
    model = load_model(package, num_threads=num_threads, spinning=num_threads is None)
    records = [  # teacher-forced text is cut to the context; an answer too long for it is dropped
        r if r["answer_ids"] else {"prompt_ids": r["prompt_ids"][: model.ctx_len], "answer_ids": []}
        for r in records
        if not r["answer_ids"] or len(r["prompt_ids"]) + len(r["answer_ids"]) <= model.ctx_len
    ]
    if not records:
        raise ConfigError(f"no training record fits {package}'s ctx_len {model.ctx_len}")
    if not model.manifest.model.hidden_states:
        raise ConfigError(f"{package} has no hidden_states output; compile it with --hidden-states")
    model.warm_up()
    features, tokens, starts, answer_starts = [], [], [0], []
    for n, record in enumerate(records):
        sequence = record["prompt_ids"] + record["answer_ids"]
        rows = hidden_rows(model, sequence)
        assert len(rows) == len(sequence), f"{len(rows)} hidden rows for {len(sequence)} tokens"
        features.append(rows)
        tokens.append(np.asarray(sequence, np.int32))
        answer_starts.append(starts[-1] + len(record["prompt_ids"]))
        starts.append(starts[-1] + len(sequence))
        if n % 50 == 0:
            say(f"features {n + 1}/{len(records)}")
    np.savez(
        output,
        features=np.concatenate(features),
        tokens=np.concatenate(tokens),
        starts=np.asarray(starts, np.int64),
        answer_starts=np.asarray(answer_starts, np.int64),
    )
    return output


def features_from_shard(shard: Path, output: Path, lm_head) -> Path:
    """A features file (and its ``.greedy.npy`` labels, :func:`qspec.heads.train.load_features`) from a generated
    shard whose one tap is the final-norm hidden state (:func:`qspec.heads.eagle3_generate.write_generated_shards`
    with ``taps=(num_layers,)``): the source model's own features, read off the forwards that wrote the answers.
    The shard's labels are the model's argmax from the last prompt token on; inside the prompt (where the shard
    keeps the prompt's next token) ``lm_head`` gives them. Each record's last token is dropped: nothing ran on it,
    so its feature row is zeros."""
    from qspec.heads.train import greedy_labels

    data = np.load(shard)
    starts, answers = data["starts"], data["answer_starts"]
    features, labels = data["taps"][:, 0], data["labels"].astype(np.int64)
    inside = np.concatenate([np.arange(lo, a - 1) for lo, a in zip(starts[:-1], answers)]).astype(np.int64)
    labels[inside] = greedy_labels(features[inside], lm_head)
    keep = np.ones(len(labels), bool)
    keep[starts[1:] - 1] = False
    shift = np.arange(len(starts))
    tmp = output.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        features=features[keep],
        tokens=data["tokens"][keep].astype(np.int32),
        starts=starts - shift,
        answer_starts=answers - shift[:-1],
    )
    np.save(output.with_suffix(".greedy.npy"), labels[keep])
    tmp.rename(output)
    return output


def iter_sequences(data: dict) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """``(tokens, features, answer_offset)`` of every record of a features file."""
    starts, answer_starts = data["starts"], data["answer_starts"]
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        yield data["tokens"][lo:hi], data["features"][lo:hi], int(answer_starts[i] - lo)
