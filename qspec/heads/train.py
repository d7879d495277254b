"""Train a draft head on the CPU from a features file (:mod:`qspec.heads.data`).

EAGLE-1: the pair (feature ``f_t``, token ``x_{t+1}``) at head position ``t`` predicts ``f_{t+1}``;
the loss is smooth-L1 on that feature plus ``cls_weight`` times the cross-entropy of the target's next
greedy token ``x_{t+2}`` over the draft vocabulary. Medusa: head ``k`` (from 0) reads ``f_t`` and
predicts ``x_{t+2+k}``, cross-entropy weighted ``0.8^k``. Only answer tokens are labels (the target's
own greedy output); prompt positions are context.

The draft vocabulary is the most frequent answer tokens. Training is deterministic for a seed and
resumable: a checkpoint after every epoch (``train_state-METHOD.pt``), the head itself written in its
checkpoint layout (:func:`qspec.heads.modules.save_eagle` / ``save_medusa``) so other tools read it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import Field

from qspec.common import FrozenModel
from qspec.errors import ConfigError

Progress = Callable[[str], None]
MEDUSA_DECAY = 0.8
IGNORE = -100


class TrainOptions(FrozenModel):
    """How a head is trained."""

    method: str = "eagle"  # eagle | medusa
    draft_vocab: int = Field(default=8192, ge=16)  # most frequent answer tokens; the rest are never drafted
    epochs: int = Field(default=4, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    batch_sequences: int = Field(default=8, ge=1)
    cls_weight: float = Field(default=0.1, ge=0)  # EAGLE: weight of the token loss beside the feature loss
    noise: float = Field(default=0.0, ge=0)  # EAGLE: uniform noise on input features, +-noise
    medusa_heads: int = Field(default=3, ge=1)
    held_out: float = Field(default=0.05, ge=0, lt=1)  # share of sequences kept out for the learning curve
    # EAGLE: also draft this many tokens in one call (mask pairs, qspec.heads.parallel); 0: chained only
    parallel: int = Field(default=0, ge=0)
    parallel_anchors: int = Field(default=64, ge=1)  # mask groups trained per sequence and batch
    init_head: Path | None = None  # EAGLE: start from this EAGLE-1 head (its weights and draft vocabulary)
    seed: int = 0
    threads: int | None = None


def mask_token(config) -> int:
    """The token a parallel head's mask pairs embed: the model's end-of-text token (any fixed token serves; the
    learned mask feature carries the rest), else 0."""
    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    return int(eos) if isinstance(eos, int) else 0


def load_features(paths: list[Path], lm_head=None, say: Progress | None = None) -> dict:
    """Several features files (:func:`qspec.heads.data.collect_features`) as one; with ``lm_head``, also the
    target's greedy label of every position (``greedy``), computed once per file and kept beside it."""
    parts = [dict(np.load(p)) for p in paths]
    if lm_head is not None:
        for path, part in zip(paths, parts):
            cached = Path(path).with_suffix(".greedy.npy")
            if not cached.is_file() or len(np.load(cached)) != len(part["features"]):
                (say or (lambda message: None))(f"labelling {len(part['features'])} positions of {Path(path).name}")
                np.save(cached, greedy_labels(part["features"], lm_head))
            part["greedy"] = np.load(cached)
    keys = ("features", "tokens", "greedy") if lm_head is not None else ("features", "tokens")
    out = {key: np.concatenate([p[key] for p in parts]) for key in keys}
    starts, answers, offset = [np.zeros(1, np.int64)], [], 0
    for p in parts:
        starts.append(p["starts"][1:] + offset)
        answers.append(p["answer_starts"] + offset)
        offset += int(p["starts"][-1])
    out["starts"], out["answer_starts"] = np.concatenate(starts), np.concatenate(answers)
    return out


def greedy_labels(features: np.ndarray, lm_head, *, chunk: int = 4096) -> np.ndarray:
    """``[positions]``: the target's greedy next token after each position, ``argmax(lm_head(f_t))``."""
    import torch

    out = np.empty(len(features), np.int64)
    with torch.no_grad():
        for at in range(0, len(features), chunk):
            block = torch.from_numpy(features[at : at + chunk].astype(np.float32))
            out[at : at + chunk] = lm_head(block).argmax(-1).numpy()
    return out


def draft_vocabulary(data: dict, size: int) -> np.ndarray:
    """The ``size`` most frequent greedy labels (sorted ids): what the head may draft."""
    counts = np.bincount(data["greedy"])
    order = np.argsort(-counts, kind="stable")[:size]
    return np.sort(order[counts[order] > 0]).astype(np.int64)


def _split(data: dict, held_out: float, seed: int, most: int = 40) -> tuple[list[int], list[int]]:
    """(train, held-out) record indices; held-out records are answers the target generated (where a chain
    of drafts can be checked against its greedy output), at most ``most`` of them."""
    count = len(data["starts"]) - 1
    answered = [i for i in range(count) if data["answer_starts"][i] < data["starts"][i + 1]]
    order = np.random.default_rng(seed).permutation(answered)
    held = set(order[: min(most, int(round(len(answered) * held_out)))].tolist())
    return [i for i in range(count) if i not in held], sorted(held)


def _sequence(data: dict, i: int):
    lo, hi = int(data["starts"][i]), int(data["starts"][i + 1])
    return data["tokens"][lo:hi].astype(np.int64), data["features"][lo:hi], int(data["answer_starts"][i]) - lo


def _greedy(data: dict, i: int) -> np.ndarray:
    return data["greedy"][int(data["starts"][i]) : int(data["starts"][i + 1])]


def eagle_batch(data: dict, indices: list[int], t2d: np.ndarray):
    """Padded tensors for EAGLE: ids ``x_{t+1}``, features ``f_t``, positions ``t``, target features
    ``f_{t+1}``, labels (draft index of the target's greedy token after ``f_{t+1}``, IGNORE outside the
    draft vocabulary). Every position of a record is a training pair, prompt text included."""
    import torch

    seqs = [_sequence(data, i) for i in indices]
    width = max(len(tokens) - 1 for tokens, _, _ in seqs)
    hidden = seqs[0][1].shape[1]
    ids = np.zeros((len(seqs), width), np.int64)
    feats = np.zeros((len(seqs), width, hidden), np.float32)
    target = np.zeros((len(seqs), width, hidden), np.float32)
    labels = np.full((len(seqs), width), IGNORE, np.int64)
    feat_mask = np.zeros((len(seqs), width), np.float32)
    for row, ((tokens, features, _), i) in enumerate(zip(seqs, indices)):
        n = len(tokens) - 1  # pairs t = 0 .. n - 1: (f_t, x_{t+1}) -> f_{t+1}
        ids[row, :n] = tokens[1:]
        feats[row, :n] = features[:-1]
        target[row, :n] = features[1:]
        feat_mask[row, :n] = 1.0
        labels[row, :n] = t2d[_greedy(data, i)[1:]]
    positions = np.broadcast_to(np.arange(width), ids.shape).copy()
    as_tensor = torch.from_numpy
    return tuple(as_tensor(a) for a in (ids, feats, positions, target, labels, feat_mask))


def medusa_batch(data: dict, indices: list[int], t2d: np.ndarray, heads: int):
    """Padded tensors for Medusa: features ``f_t``, labels ``[B, T, heads]`` (head k: ``x_{t+2+k}``)."""
    import torch

    seqs = [_sequence(data, i) for i in indices]
    width = max(len(tokens) for tokens, _, _ in seqs)
    hidden = seqs[0][1].shape[1]
    feats = np.zeros((len(seqs), width, hidden), np.float32)
    labels = np.full((len(seqs), width, heads), IGNORE, np.int64)
    for row, ((tokens, features, _), i) in enumerate(zip(seqs, indices)):
        n = len(tokens)
        feats[row, :n] = features
        greedy = _greedy(data, i)
        for k in range(heads):  # head k at f_t: the greedy token after f_{t+1+k}
            labels[row, : max(0, n - 1 - k), k] = t2d[greedy[1 + k :]]
    return torch.from_numpy(feats), torch.from_numpy(labels)


def _eagle_loss(head, batch, options: TrainOptions, generator):
    import torch
    import torch.nn.functional as F

    ids, feats, positions, target, labels, feat_mask = batch
    if options.noise:
        feats = feats + (torch.rand(feats.shape, generator=generator) * 2 - 1) * options.noise
    pred = head(ids, feats, positions)
    per = F.smooth_l1_loss(pred, target, reduction="none").mean(-1)
    reg = (per * feat_mask).sum() / feat_mask.sum().clamp(min=1)
    cls = F.cross_entropy(head.logits(pred).flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    return reg + options.cls_weight * cls, {"reg": reg.item(), "ce": cls.item()}


def _medusa_loss(head, batch, options: TrainOptions, generator):
    import torch.nn.functional as F

    feats, labels = batch
    logits = head(feats)  # [B, T, heads, draft_vocab]
    total, parts = 0.0, {}
    for k in range(labels.shape[-1]):
        ce = F.cross_entropy(logits[:, :, k].flatten(0, 1), labels[:, :, k].flatten(), ignore_index=IGNORE)
        total = total + MEDUSA_DECAY**k * ce
        parts[f"ce{k}"] = ce.item()
    return total, parts


def evaluate_eagle(head, data: dict, indices: list[int], t2d: np.ndarray, *, steps: int = 3) -> list[float]:
    """Held-out chain accuracy: ``acc[j]`` = share of answer positions whose drafts 1..j+1 (each fed its own
    predicted feature and token, as at run time) all equal the target's greedy tokens."""
    import torch

    hits = np.zeros(steps)
    total = 0
    with torch.no_grad():
        for i in indices:
            tokens, features, answer = _sequence(data, i)
            n = len(tokens)
            ids = torch.from_numpy(tokens[1:][None])
            feats = torch.from_numpy(features[:-1].astype(np.float32)[None])
            positions = torch.arange(n - 1)[None]
            pred = head(ids, feats, positions)[0]  # [n - 1, H]: f_hat_{t+1}
            draft = head.to_target(head.logits(pred).argmax(-1))  # x_hat_{t+2}
            for t in range(max(0, answer - 2), n - 2):
                total += 1
                if int(draft[t]) != tokens[t + 2]:
                    continue
                hits[0] += 1
                # Chain: feed (f_hat, x_hat) at t + 1 with the true prefix; a short teacher-forced re-run.
                ctx_ids = torch.cat((ids[:, : t + 1], draft[None, t : t + 1]), 1)
                ctx_feats = torch.cat((feats[:, : t + 1], pred[None, t : t + 1]), 1)
                ok = True
                for j in range(1, steps):
                    if t + 2 + j >= n:
                        ok = False
                        break
                    out = head(ctx_ids, ctx_feats, torch.arange(ctx_ids.shape[1])[None])[0, -1]
                    nxt = head.to_target(head.logits(out).argmax(-1))
                    if int(nxt) != tokens[t + 2 + j]:
                        ok = False
                        break
                    hits[j] += 1
                    ctx_ids = torch.cat((ctx_ids, nxt.view(1, 1)), 1)
                    ctx_feats = torch.cat((ctx_feats, out.view(1, 1, -1)), 1)
                if not ok:
                    continue
    return (hits / max(total, 1)).tolist()


def evaluate_medusa(head, data: dict, indices: list[int], t2d: np.ndarray) -> list[float]:
    """Held-out accuracy of the chain of Medusa heads 1..j+1 (all right), per j."""
    import torch

    heads = head.num_heads
    hits, total = np.zeros(heads), 0
    with torch.no_grad():
        for i in indices:
            tokens, features, answer = _sequence(data, i)
            logits = head(torch.from_numpy(features.astype(np.float32)[None]))[0]  # [n, heads, V]
            drafts = head.to_target(logits.argmax(-1)).numpy()
            for t in range(max(0, answer - 2), len(tokens) - 1 - heads):
                total += 1
                for k in range(heads):
                    if drafts[t, k] != tokens[t + 2 + k]:
                        break
                    hits[k] += 1
    return (hits / max(total, 1)).tolist()


def train_head(
    features: list[Path],
    target_model,
    output: Path,
    options: TrainOptions,
    *,
    state_dir: Path | None = None,
    progress: Progress | None = None,
    evals: dict[str, list[Path]] | None = None,
) -> dict:
    """Train a head for ``target_model`` (the HF model the package was exported from: its embeddings and
    LM head) on ``features``; write it to ``output`` in its layout with ``train_log.json``. Resumes from
    ``train_state-METHOD.pt`` in ``state_dir`` (default: ``output``), written after every epoch. ``evals``:
    more features files (MT-bench answers, say), whose chain accuracy every epoch logs under its name beside the
    held-out one (``chain_accuracy``): the learning curve on data the head never trains on."""
    import torch

    from qspec.heads import modules, parallel

    say = progress or (lambda message: None)
    if options.method not in ("eagle", "medusa"):
        raise ConfigError(f"method {options.method!r}: use eagle or medusa")
    if (options.parallel or options.init_head) and options.method != "eagle":
        raise ConfigError("--parallel and --init-head are for --method eagle")
    if options.parallel == 1:
        raise ConfigError("--parallel 1 drafts one token, as a chained head does: give 2 or more (or 0)")
    torch.manual_seed(options.seed)
    if options.threads:
        torch.set_num_threads(options.threads)
    data = load_features(features, target_model.get_output_embeddings(), say)
    train_ids, held_ids = _split(data, options.held_out, options.seed)
    eval_sets = {name: load_features(paths) for name, paths in (evals or {}).items()}
    vocab = target_model.config.vocab_size
    init = modules.load_eagle(options.init_head, target_model).train() if options.init_head else None
    if init is None:
        draft_ids = draft_vocabulary(data, options.draft_vocab)
    else:  # the head's own draft vocabulary (the target's whole one when it has none)
        draft_ids = init.draft_ids.numpy() if init.draft_ids is not None else np.arange(vocab)
    t2d = np.full(vocab, IGNORE, np.int64)
    t2d[draft_ids] = np.arange(len(draft_ids))
    ids_t = torch.from_numpy(draft_ids)
    if init is not None:
        head = init
    elif options.method == "eagle":
        head = modules.eagle_from_target(target_model, draft_ids=ids_t)
    else:
        head = modules.medusa_from_target(target_model, num_heads=options.medusa_heads, draft_ids=ids_t)
    if options.parallel and getattr(head, "parallel", None) is None:
        settings = parallel.ParallelDrafting(depth=options.parallel, mask_token_id=mask_token(target_model.config))
        parallel.enable_parallel(head, settings, torch.from_numpy(data["features"].mean(0, dtype=np.float64)))
    params = head.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
    batches_per_epoch = math.ceil(len(train_ids) / options.batch_sequences)
    total_steps = batches_per_epoch * options.epochs
    warmup = max(1, min(20, total_steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)),
    )
    output.mkdir(parents=True, exist_ok=True)
    state_path = (state_dir or output) / f"train_state-{options.method}.pt"
    state_path.parent.mkdir(parents=True, exist_ok=True)
    log = {
        "options": options.model_dump(mode="json"),
        "train_sequences": len(train_ids),
        "held_out": len(held_ids),
        "epochs": [],
    }
    start_epoch = 0
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start_epoch, log = state["epoch"], state["log"]
        say(f"resuming after epoch {start_epoch}")
    generator = torch.Generator().manual_seed(options.seed)
    train_positions = int(sum(data["starts"][i + 1] - data["starts"][i] for i in train_ids))
    begin = time.perf_counter()
    for epoch in range(start_epoch, options.epochs):
        order = np.random.default_rng(options.seed + epoch).permutation(train_ids).tolist()
        head.train()
        sums: dict[str, float] = {}
        epoch_begin = time.perf_counter()
        for b in range(batches_per_epoch):
            chunk = order[b * options.batch_sequences : (b + 1) * options.batch_sequences]
            if options.parallel:
                loss, parts = parallel.parallel_loss(
                    head,
                    eagle_batch(data, chunk, t2d),
                    anchors=options.parallel_anchors,
                    cls_weight=options.cls_weight,
                    ignore=IGNORE,
                    generator=generator,
                    noise=options.noise,
                )
            elif options.method == "eagle":
                loss, parts = _eagle_loss(head, eagle_batch(data, chunk, t2d), options, generator)
            else:
                loss, parts = _medusa_loss(
                    head, medusa_batch(data, chunk, t2d, options.medusa_heads), options, generator
                )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            for key, value in parts.items():
                sums[key] = sums.get(key, 0.0) + value
            if b % 20 == 0:
                done = epoch * batches_per_epoch + b + 1 - start_epoch * batches_per_epoch
                left = (time.perf_counter() - begin) / done * (total_steps - epoch * batches_per_epoch - b - 1)
                say(
                    f"epoch {epoch + 1}/{options.epochs} batch {b + 1}/{batches_per_epoch} loss {loss.item():.3f} "
                    f"ETA {left / 60:.1f} min"
                )
        head.eval()
        evaluate = evaluate_eagle if options.method == "eagle" else evaluate_medusa
        accuracy = evaluate(head, data, held_ids, t2d)
        entry = {
            "epoch": epoch + 1,
            "train": {k: round(v / batches_per_epoch, 4) for k, v in sums.items()},
            "held_out_chain_accuracy": [round(a, 4) for a in accuracy],
            "seconds": round(time.perf_counter() - epoch_begin, 1),
        }
        if eval_sets:
            entry["chain_accuracy"] = {
                name: [round(a, 4) for a in evaluate(head, d, list(range(len(d["starts"]) - 1)), t2d)]
                for name, d in eval_sets.items()
            }
        if options.parallel:  # the same positions' drafts from one call each
            entry["held_out_one_call_accuracy"] = [
                round(a, 4) for a in parallel.evaluate_parallel(head, data, held_ids, sequence=_sequence)
            ]
            entry["one_call_accuracy"] = {
                name: [
                    round(a, 4)
                    for a in parallel.evaluate_parallel(head, d, list(range(len(d["starts"]) - 1)), sequence=_sequence)
                ]
                for name, d in eval_sets.items()
            }
        log["epochs"].append(entry)
        say(f"epoch {epoch + 1}: held-out chain accuracy {entry['held_out_chain_accuracy']}")
        torch.save(
            {
                "head": head.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "epoch": epoch + 1,
                "log": log,
            },
            state_path,
        )
    log |= {"train_positions": train_positions, "draft_vocab": int(len(draft_ids))}
    if options.method == "eagle":
        modules.save_eagle(head, output)
    else:
        modules.save_medusa(head, output)
    (output / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return log
