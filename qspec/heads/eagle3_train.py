"""Train an EAGLE-3 head with the training-time test, and measure its chain acceptance offline.

Loss (EAGLE-3, SpecForge): the head is unrolled ``steps`` times on its own features
(:meth:`~qspec.heads.eagle3_model.Eagle3Head.unroll`); step ``j`` at row ``t`` is scored by the
cross-entropy of the target's greedy token after position ``t + 1 + j`` over the draft vocabulary,
and the steps are summed with weights ``0.8^j``. No feature regression. Only labels that predict an
answer token count (prompt positions are context); labels outside the draft vocabulary are skipped.

Acceptance at depth ``k`` (:func:`chain_acceptance`): over the answer positions that have ``k_max`` more
labels, the share whose drafts ``1..k`` all equal the target's greedy tokens. Because a chained step
reads the true next token and the true token equals the draft while the chain holds, the unroll's
outputs are exactly what a chained head drafts at run time, so this is measured in one unroll.

Training is resumable: ``state.pt`` in the work folder holds the head, optimizer, schedule, the batch
reached and the learning curve, written every ``save_every`` batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from qspec.common import FrozenModel
from qspec.heads.eagle3_data import record, record_count

Progress = Callable[[str], None]
DECAY = 0.8
IGNORE = -100


class Eagle3Options(FrozenModel):
    """How an EAGLE-3 head is trained."""

    steps: int = Field(default=4, ge=1)  # unroll steps of the training-time test
    draft_vocab: int = Field(default=8192, ge=16)
    epochs: int = Field(default=2, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    batch_tokens: int = Field(default=512, ge=16)  # tokens of padded sequences per batch
    max_tokens: int = Field(default=512, ge=8)  # sequences cut to this many tokens
    held_out: int = Field(default=12, ge=0)  # records kept out for the learning curve
    eval_every: int = Field(default=80, ge=0)  # batches between learning-curve points (0: per epoch)
    save_every: int = Field(default=50, ge=1)
    eval_depth: int = Field(default=3, ge=1)
    init: Literal["lens", "random"] = "random"  # see qspec.heads.eagle3_model.head_from_target
    seed: int = 0


def step_weights(steps: int) -> list[float]:
    """``0.8^j`` per unroll step. Example: 3 steps -> [1.0, 0.8, 0.64]."""
    return [DECAY**j for j in range(steps)]


def step_labels(labels: np.ndarray, answer: int, steps: int, t2d: np.ndarray) -> np.ndarray:
    """``[steps, n]`` draft-vocabulary labels of one record: step ``j`` row ``t`` -> ``t2d[labels[t + 1 + j]]``
    where that label predicts an answer token and is not the record's last (IGNORE elsewhere).
    Example: n = 5, answer = 3, one step: rows 1 and 2 (labels 2 and 3) count."""
    n = len(labels)
    out = np.full((steps, n), IGNORE, np.int64)
    for j in range(steps):
        lo, hi = max(0, answer - 2 - j), n - 3 - j  # rows t whose label position t + 1 + j is in [answer - 1, n - 2]
        if hi >= lo:
            out[j, lo : hi + 1] = t2d[labels[lo + 1 + j : hi + 2 + j]]
    return out


def make_batch(data: dict, indices: list[int], steps: int, t2d: np.ndarray, max_tokens: int):
    """Right-padded ``(input_ids [B, T], taps [B, T, 3, H] fp32, labels [steps, B, T])``. Row ``t`` of a
    record pairs tap ``t`` with token ``t + 1``."""
    import torch

    recs = [record(data, i) for i in indices]
    width = min(max_tokens, max(len(r["tokens"]) for r in recs)) - 1
    hidden = recs[0]["taps"].shape[-1]
    ids = np.zeros((len(recs), width), np.int64)
    taps = np.zeros((len(recs), width, 3, hidden), np.float32)
    labels = np.full((steps, len(recs), width), IGNORE, np.int64)
    for row, r in enumerate(recs):
        n = min(len(r["tokens"]), max_tokens)
        ids[row, : n - 1] = r["tokens"][1:n]
        taps[row, : n - 1] = r["taps"][: n - 1]
        labels[:, row, : n - 1] = step_labels(r["labels"][:n], r["answer"], steps, t2d)[:, : n - 1]
    return torch.from_numpy(ids), torch.from_numpy(taps), torch.from_numpy(labels)


def unroll_loss(head, batch, steps: int):
    """``(sum_j 0.8^j CE_j, [CE_j])`` of one batch."""
    import torch.nn.functional as F

    ids, taps, labels = batch
    total, parts = 0.0, []
    for j, (weight, logits) in enumerate(zip(step_weights(steps), head.unroll(ids, taps, steps))):
        if (labels[j] != IGNORE).any():
            ce = F.cross_entropy(logits.flatten(0, 1), labels[j].flatten(), ignore_index=IGNORE)
            total = total + weight * ce
            parts.append(ce.item())
    return total, parts


def chain_acceptance(head, data: dict, indices: list[int], depth: int = 3) -> dict:
    """Chain acceptance per depth over the answer positions of ``indices`` (see the module docstring):
    ``{"chain": [a_1..a_depth], "positions": n}``. A position counts where its next ``depth`` tokens are the
    target's greedy tokens (so the chain the head would draft is checked against the real continuation)."""
    import torch

    hits, total = np.zeros(depth), 0
    with torch.no_grad():
        for i in indices:
            r = record(data, i)
            tokens, labels, n = r["tokens"].astype(np.int64), r["labels"].astype(np.int64), len(r["tokens"])
            ids = torch.from_numpy(tokens[1:][None])
            taps = torch.from_numpy(r["taps"][:-1].astype(np.float32)[None])
            drafts = [head.to_target(lg[0].argmax(-1)).numpy() for lg in head.unroll(ids, taps, depth)]
            greedy = tokens[1:] == labels[:-1]  # token s + 1 is the target's greedy choice after s
            for t in range(max(0, r["answer"] - 1), n - 1 - depth):  # row answer - 1 drafts token answer + 1
                # drafts at row t predict labels[t + 1 + j]; chain inputs are tokens t + 1 .. t + depth
                if not greedy[t : t + depth + 1].all():
                    continue
                total += 1
                for j in range(depth):
                    if drafts[j][t] != labels[t + 1 + j]:
                        break
                    hits[j] += 1
    return {"chain": [round(float(h / max(total, 1)), 4) for h in hits], "positions": total}


def draft_vocabulary(data: dict, indices: list[int], size: int) -> np.ndarray:
    """The ``size`` most frequent greedy labels of the training records (sorted target ids)."""
    counts = np.zeros(int(data["labels"].max()) + 1, np.int64)
    for i in indices:
        np.add.at(counts, record(data, i)["labels"], 1)
    order = np.argsort(-counts, kind="stable")[:size]
    return np.sort(order[counts[order] > 0]).astype(np.int64)


def batches(data: dict, indices: list[int], batch_tokens: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Records grouped by length into batches of about ``batch_tokens`` padded tokens, in a seeded order."""
    lengths = {i: min(max_tokens, int(data["starts"][i + 1] - data["starts"][i])) for i in indices}
    ordered = sorted(indices, key=lambda i: lengths[i])
    out, current = [], []
    for i in ordered:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    rng = np.random.default_rng(seed)
    return [out[k] for k in rng.permutation(len(out))]


def generated(data: dict, i: int) -> bool:
    """Whether record ``i``'s answer is the target's own greedy text (not teacher-forced human text)."""
    r = record(data, i)
    a = r["answer"]
    return len(r["tokens"]) - a > 4 and float(np.mean(r["tokens"][a + 1 :] == r["labels"][a:-1])) > 0.9


def split(data: dict, held_out: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) record indices; held-out records are answers the target generated, so a chain of
    drafts is checked against its greedy continuation."""
    count = record_count(data)
    answered = [i for i in range(count) if generated(data, i)]
    held = set(np.random.default_rng(seed).permutation(answered)[:held_out].tolist())
    return [i for i in range(count) if i not in held], sorted(held)


def train(
    head_factory: Callable[[np.ndarray], object],
    data: dict,
    work: Path,
    options: Eagle3Options,
    *,
    evals: dict[str, tuple[dict, list[int]]] | None = None,
    progress: Progress | None = None,
):
    """Train a head (``head_factory(draft_ids)``) on ``data``; returns ``(head, log)``. ``evals`` name more
    record sets to measure at every learning-curve point (e.g. MT-bench's first turns, evaluation only)."""
    import torch

    say = progress or (lambda message: None)
    torch.manual_seed(options.seed)
    train_ids, held_ids = split(data, options.held_out, options.seed)
    draft_ids = draft_vocabulary(data, train_ids, options.draft_vocab)
    t2d = np.full(int(max(data["labels"].max(), draft_ids.max())) + 1, IGNORE, np.int64)
    t2d[draft_ids] = np.arange(len(draft_ids))
    head = head_factory(draft_ids)
    params = head.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
    plan = [
        batches(data, train_ids, options.batch_tokens, options.max_tokens, options.seed + e)
        for e in range(options.epochs)
    ]
    total = sum(map(len, plan))
    warmup = max(1, min(50, total // 20))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    evals = {"held_out": (data, held_ids)} | (evals or {})
    log = {
        "options": options.model_dump(),
        "train_records": len(train_ids),
        "held_out_records": len(held_ids),
        "draft_vocab": int(len(draft_ids)),
        "curve": [],
        "seconds": 0.0,
        "tokens": 0,
    }
    state_path, done = work / "state.pt", 0
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        done, log = state["done"], state["log"]
        say(f"resuming after batch {done}/{total}")

    def measure():
        head.eval()
        point = {"batches": done, "train_tokens": log["tokens"], "seconds": round(log["seconds"], 1)}
        point |= {name: chain_acceptance(head, d, ids, options.eval_depth) for name, (d, ids) in evals.items()}
        log["curve"].append(point)
        say(f"curve: {point}")
        head.train()

    def save():
        torch.save(
            {
                "head": head.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "done": done,
                "log": log,
            },
            state_path.with_suffix(".tmp"),
        )
        state_path.with_suffix(".tmp").rename(state_path)

    flat = [b for epoch in plan for b in epoch]
    every = options.eval_every or len(plan[0])
    head.train()
    while done < total:
        begin = time.perf_counter()
        batch = make_batch(data, flat[done], options.steps, t2d, options.max_tokens)
        loss, parts = unroll_loss(head, batch, options.steps)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        schedule.step()
        done += 1
        log["tokens"] += int((batch[2][0] != IGNORE).sum())
        log["seconds"] += time.perf_counter() - begin
        if done % 10 == 0:
            say(
                f"batch {done}/{total} loss {loss.item():.3f} ce {[round(p, 2) for p in parts]} "
                f"{log['seconds'] / done * (total - done) / 60:.1f} min left"
            )
        if done % every == 0 or done == total:
            measure()
        if done % options.save_every == 0 or done == total:
            save()
    return head, log
