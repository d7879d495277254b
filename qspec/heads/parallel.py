"""Single-call (parallel) drafting with an EAGLE-1 head: ``K`` drafts from one head call.

The chained head drafts ``d_1`` from the last verified pair ``(h_p, x_{p+1})`` at position ``p`` and then runs
one more call per draft, each reading the previous call's feature and draft. A parallel head also reads, in
the same call, ``K - 1`` **mask pairs** at positions ``p + 1 .. p + K - 1``: the embedding of a fixed token
(``mask_token_id``) and a learned feature (``mask_hidden``) in place of the pairs it does not know yet. Mask
slot ``s`` attends to the verified pairs and to the mask slots before it, and its output's LM-head argmax
drafts ``d_{s + 2}`` (vLLM's ``parallel_drafting`` with its ``mask_hidden``, P-EAGLE / PARD). The head graph is
the chained head's, called with ``K`` kept rows; the next step's catch-up overwrites the mask pairs' cache
rows with the verified pairs, as the target overwrites rejected drafts.

Worked example, ``K = 3``, prompt ``x_0..x_3`` and the target's next token ``x_4``: one call reads
``(h_0, x_1) .. (h_3, x_4)`` at positions 0..3 and two mask pairs at 4 and 5; the rows at 3, 4, 5 draft
``x_5, x_6, x_7``.

Training (:func:`parallel_loss`): EAGLE-1's loss on the verified pairs, plus, for anchors ``t`` sampled in each
sequence, ``K - 1`` mask slots after pair ``t`` whose row ``s`` is trained on the target's greedy token
``x_{t + s + 3}``, one attention mask over pairs and slots (each slot sees pairs ``<= t`` and its anchor's
earlier slots). The head stays a chained EAGLE-1 head too: its verified-pair loss is EAGLE-1's.

Checkpoint: EAGLE-1's layout plus the tensor ``mask_hidden`` [H] and ``"parallel_drafting": {"depth": K,
"mask_token_id": id}`` in ``config.json`` (qspec's own keys: no public loader reads a parallel EAGLE-1 head).
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from qspec.common import FrozenModel

CONFIG_KEY = "parallel_drafting"
MASK_WEIGHT = "mask_hidden"
DECAY = 0.8  # weight of mask slot s's loss: DECAY ** (s + 1), as EAGLE-3's training-time test weighs its steps


class ParallelDrafting(FrozenModel):
    """A parallel head's settings: drafts per call, and the token whose embedding the mask pairs read."""

    depth: int = Field(ge=2)
    mask_token_id: int = Field(ge=0)


def enable_parallel(head, settings: ParallelDrafting, init: torch.Tensor | None = None):
    """Give an EAGLE-1 ``head`` its mask feature (``init``, default zeros) and settings; returns ``head``."""
    hidden = head.fc.weight.shape[0]
    value = torch.zeros(hidden) if init is None else init.detach().float().reshape(hidden).clone()
    head.mask_hidden = torch.nn.Parameter(value)
    head.parallel = settings
    return head


def mask_pair(head) -> torch.Tensor:
    """``fc(cat(embed(mask_token_id), mask_hidden))`` [H]: what every mask slot reads."""
    token = torch.tensor([head.parallel.mask_token_id])
    embedded = head.embed_tokens(token)[0]
    return head.fc(torch.cat((embedded, head.mask_hidden.to(head.fc.weight.dtype))))


def group_forward(
    head, ids: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over ``n`` verified pairs (positions ``0..n-1``) and ``K - 1`` mask slots after each anchor.

    ``ids`` [B, n], ``feats`` [B, n, H]; ``anchors`` [B, A] pair indices (``-1``: none). Returns the pairs'
    outputs [B, n, H] (as :meth:`EagleHead.forward`) and the slots' [B, A, K - 1, H]."""
    batch, n = ids.shape
    slots = head.parallel.depth - 1
    count = anchors.shape[1]
    real = head.fc(torch.cat((head.embed_tokens(ids), feats.to(head.fc.weight.dtype)), dim=-1))
    masks = mask_pair(head).expand(batch, count * slots, -1)
    x = torch.cat((real, masks), dim=1)
    offsets = torch.arange(1, slots + 1)
    slot_positions = (anchors.clamp(min=0)[:, :, None] + offsets).reshape(batch, -1)
    positions = torch.cat((torch.arange(n).expand(batch, n), slot_positions), dim=1)
    allowed = torch.zeros(batch, n + count * slots, n + count * slots, dtype=torch.bool)
    allowed[:, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    anchor_of = anchors.repeat_interleave(slots, dim=1)  # [B, A * slots]
    allowed[:, n:, :n] = torch.arange(n)[None, None, :] <= anchor_of[:, :, None]
    same = torch.arange(count).repeat_interleave(slots)
    order = torch.arange(slots).repeat(count)
    allowed[:, n:, n:] = (same[:, None] == same[None, :]) & (order[None, :] <= order[:, None])
    allowed[:, n:, n:] &= (anchor_of >= 0)[:, :, None]
    allowed[:, n:, :n] &= (anchor_of >= 0)[:, :, None]
    idle = ~allowed.any(-1)  # a slot of no anchor attends to itself only (its output is never read)
    allowed |= idle[:, :, None] & torch.eye(allowed.shape[-1], dtype=torch.bool)[None]
    bias = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)
    cos_sin = head.rotary_emb(x, positions)
    out = head.layers[0](x, attention_mask=bias[:, None], position_ids=positions, position_embeddings=cos_sin)
    return out[:, :n], out[:, n:].reshape(batch, count, slots, -1)


def sample_anchors(lengths: list[int], count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct pair indices per sequence (all of them when it has fewer), ``-1`` padded."""
    anchors = torch.full((len(lengths), count), -1, dtype=torch.long)
    for row, length in enumerate(lengths):
        picked = torch.randperm(length, generator=generator)[:count] if length > 0 else torch.empty(0)
        anchors[row, : len(picked)] = picked.sort().values
    return anchors


def slot_labels(labels: torch.Tensor, anchors: torch.Tensor, slots: int, ignore: int) -> torch.Tensor:
    """[B, A, slots]: slot ``s`` of anchor ``t`` is trained on ``labels[t + 1 + s]`` (pair ``t + 1 + s``'s label:
    the greedy token after ``x_{t + s + 2}``), ``ignore`` past the sequence or for no anchor."""
    batch, n = labels.shape
    index = anchors[:, :, None] + 1 + torch.arange(slots)
    valid = (anchors[:, :, None] >= 0) & (index < n)
    picked = torch.gather(labels, 1, index.clamp(0, n - 1).reshape(batch, -1)).reshape(index.shape)
    return torch.where(valid, picked, torch.full_like(picked, ignore))


def parallel_loss(head, batch, *, anchors: int, cls_weight: float, ignore: int, generator, noise: float = 0.0):
    """EAGLE-1's loss on the verified pairs plus the mask slots' weighted cross-entropy (module doc)."""
    import torch.nn.functional as F

    ids, feats, _positions, target, labels, feat_mask = batch
    if noise:
        feats = feats + (torch.rand(feats.shape, generator=generator) * 2 - 1) * noise
    lengths = feat_mask.sum(1).long().tolist()
    picked = sample_anchors(lengths, anchors, generator)
    real, slots = group_forward(head, ids, feats, picked)
    per = F.smooth_l1_loss(real, target, reduction="none").mean(-1)
    reg = (per * feat_mask).sum() / feat_mask.sum().clamp(min=1)
    first = F.cross_entropy(head.logits(real).flatten(0, 1), labels.flatten(), ignore_index=ignore)
    wanted = slot_labels(labels, picked, slots.shape[2], ignore)
    total = reg + cls_weight * first
    parts = {"reg": reg.item(), "ce": first.item()}
    for s in range(slots.shape[2]):
        ce = F.cross_entropy(head.logits(slots[:, :, s]).flatten(0, 1), wanted[:, :, s].flatten(), ignore_index=ignore)
        total = total + DECAY ** (s + 1) * ce
        parts[f"ce_slot{s + 1}"] = ce.item()
    return total, parts


def evaluate_parallel(head, data: dict, indices: list[int], *, sequence) -> list[float]:
    """Held-out accuracy of one call's drafts: ``acc[j]`` = share of answer positions whose drafts ``1..j+1``
    (the pair's own row and ``j`` mask slots, all from one call) equal the target's next tokens.
    ``sequence(data, i)``: (tokens, features, answer start) of record ``i``."""
    depth = head.parallel.depth
    hits, total = np.zeros(depth), 0
    with torch.no_grad():
        for i in indices:
            tokens, features, answer = sequence(data, i)
            n = len(tokens) - 1
            first = max(0, answer - 2)
            if n - 1 <= first:
                continue
            anchors = torch.arange(first, n - 1)[None]
            ids = torch.from_numpy(tokens[1:][None])
            feats = torch.from_numpy(features[:-1].astype(np.float32)[None])
            real, slots = group_forward(head, ids, feats, anchors)
            drafts = [head.to_target(head.logits(real[0, anchors[0]]).argmax(-1))]
            drafts += [head.to_target(head.logits(slots[0, :, s]).argmax(-1)) for s in range(depth - 1)]
            right = torch.ones(anchors.shape[1], dtype=torch.bool)
            for j, draft in enumerate(drafts):
                index = anchors[0] + 2 + j  # draft j + 1 of pair t is x_{t + 2 + j}
                inside = index < len(tokens)
                truth = torch.from_numpy(tokens)[index.clamp(max=len(tokens) - 1)]
                right &= inside & (draft == truth)
                hits[j] += int(right.sum())
            total += anchors.shape[1]
    return (hits / max(total, 1)).tolist()
