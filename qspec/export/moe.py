"""Mixture-of-experts MLPs in static shapes, as QEfficient exports them: every expert runs on every token.

transformers' MoE blocks (Mixtral, Qwen3-MoE, DeepSeek-V3) send each token to its top-k experts with
data-dependent gathers and a loop over the experts hit, which a statically compiled graph cannot hold. Here the
family's router (``Adapter.router``) turns the block's own router weights into a dense routing table
``[batch, seq, experts]`` (a token's weight for each of its top-k experts, exact zeros elsewhere), every expert's
MLP runs on every token, and the table weighs and sums their outputs: two MatMuls over the experts' stacked
weights (:func:`static_moe`). Same result, static shapes, ``num_experts / top_k`` times the MLP's arithmetic.

Everything stays ``[batch, seq, ...]``, no token axis flattened and restored: a shape the graph computes from
the call's sizes would be the exported call's, and the ort backend runs the MLPs on fewer tokens than the call
holds (its rows trimmed or its live tokens packed, :mod:`qspec.backends.ort_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

Router = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (router module, x [b, s, h]) -> table [b, s, experts]


def is_moe(mlp: nn.Module) -> bool:
    """A transformers MoE block: a router (``gate``) and stacked experts (``experts.gate_up_proj``)."""
    return hasattr(mlp, "experts") and hasattr(mlp.experts, "gate_up_proj") and hasattr(mlp, "gate")


def dense_table(chosen: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[..., experts]`` from the top-k ``chosen`` experts and their ``weights`` ``[..., k]``; zero elsewhere.

    Example, 4 experts: chosen ``[3, 0]``, weights ``[0.7, 0.3]`` -> ``[0.3, 0, 0, 0.7]``.
    """
    hit = chosen[..., None] == torch.arange(num_experts, dtype=chosen.dtype)  # [..., k, experts]
    return (hit.to(weights.dtype) * weights[..., None]).sum(dim=-2)


def softmax_top_k(gate: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mixtral and Qwen3-MoE: softmax over the experts, top-k, renormalised over the k unless the router says
    ``norm_topk_prob=False`` (Mixtral always renormalises)."""
    probs = torch.softmax(F.linear(x, gate.weight).float(), dim=-1)  # [b, s, experts]
    top, chosen = torch.topk(probs, gate.top_k, dim=-1)
    if getattr(gate, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return dense_table(chosen, top.to(x.dtype), gate.weight.shape[0])


def group_limited(gate: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 (``noaux_tc``): sigmoid scores; a group's score is the sum of its two best biased scores
    (``+ e_score_correction_bias``), only the ``topk_group`` best groups compete, top-k experts among them by
    biased score, weighed by their unbiased scores (renormalised if ``norm_topk_prob``) times
    ``routed_scaling_factor``.

    Example, 4 experts in 2 groups, topk_group 1, top 2: biased scores ``[.9, .1, .6, .5]`` -> groups
    ``[1.0, 1.1]`` -> group 1 alone -> experts 2 and 3.
    """
    num_experts, groups = gate.weight.shape[0], gate.num_group
    size = num_experts // groups
    scores = F.linear(x.float(), gate.weight.float()).sigmoid()  # [b, s, experts]
    biased = scores + gate.e_score_correction_bias
    group_scores = torch.stack(
        [biased[..., g * size : (g + 1) * size].topk(2, dim=-1)[0].sum(dim=-1) for g in range(groups)], dim=-1
    )  # [b, s, groups]
    best = torch.topk(group_scores, gate.topk_group, dim=-1)[1]
    kept = dense_table(best, torch.ones_like(group_scores[..., :1]).expand_as(best), groups) > 0  # [b, s, groups]
    group_of = torch.arange(num_experts, dtype=torch.int64) // size
    allowed = kept.index_select(-1, group_of)  # [b, s, experts]
    chosen = torch.topk(biased.masked_fill(~allowed, float("-inf")), gate.top_k, dim=-1)[1]
    weights = scores.gather(-1, chosen)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return dense_table(chosen, (weights * gate.routed_scaling_factor).to(x.dtype), num_experts)


def moe_info(model: nn.Module, router: Router | None):
    """The :class:`~qspec.package.MoEInfo` of ``model``'s MoE blocks: routed by ONNX Runtime's ``MoE`` operator
    itself when ``router`` is :func:`softmax_top_k` (what the operator computes), by the graph's routing table
    when it is :func:`group_limited` (DeepSeek-V3); None for a dense model.

    Example: Qwen3-MoE with ``mlp_only_layers=[1]`` of 2 layers -> layers ``[0]``, normalize ``norm_topk_prob``,
    routing ``"softmax"``; DeepSeek-V3 with ``first_k_dense_replace=1`` of 2 layers -> layers ``[1]``, ``"table"``.
    """
    from qspec.package import MoEInfo

    layers = [i for i, layer in enumerate(model.model.layers) if is_moe(layer.mlp)]
    if router not in (softmax_top_k, group_limited) or not layers:
        return None
    gate = model.model.layers[layers[0]].mlp.gate
    return MoEInfo(
        layers=layers,
        num_experts=gate.weight.shape[0],
        top_k=gate.top_k,
        normalize=bool(getattr(gate, "norm_topk_prob", True)),
        routing="softmax" if router is softmax_top_k else "table",
    )


def stack_experts(model: nn.Module) -> int:
    """:func:`stack_block` on every MoE block of ``model``; returns how many."""
    blocks = [layer.mlp for layer in model.model.layers if is_moe(layer.mlp)]
    for block in blocks:
        stack_block(block)
    return len(blocks)


def stack_block(block: nn.Module) -> None:
    """Give a MoE block its experts as two 2-D input-major weights.

    ``experts.up_stacked`` ``[hidden, 2 * experts * inter]``: every expert's gate columns, then every expert's up
    columns; ``experts.down_stacked`` ``[experts * inter, hidden]``: the experts' down projections one under the
    other. The experts' MLPs are then two plain MatMuls (what the runtime's weight formats quantize), and the
    table-weighted sum over the experts is the second MatMul's own sum.
    """
    experts = block.experts
    gate_up = experts.gate_up_proj.detach()  # [experts, 2 * inter, hidden]
    rows, hidden = gate_up.shape[1:]
    gate, up = gate_up[:, : rows // 2], gate_up[:, rows // 2 :]
    stacked = torch.cat((gate.reshape(-1, hidden), up.reshape(-1, hidden))).t()  # [hidden, 2 * experts * inter]
    down = experts.down_proj.detach().transpose(1, 2).reshape(-1, hidden)  # [experts * inter, hidden]
    experts.up_stacked = nn.Parameter(stacked.contiguous(), requires_grad=False)
    experts.down_stacked = nn.Parameter(down.contiguous(), requires_grad=False)


def static_moe(block: nn.Module, x: torch.Tensor, router: Router) -> torch.Tensor:
    """``block`` (a MoE block, :func:`is_moe`, its experts stacked by :func:`stack_block`) on ``x``
    ``[batch, seq, hidden]`` with every expert computed, weighed by ``router``'s table, plus the block's shared
    experts if it has them (DeepSeek-V3).

    Example, 2 experts of width 3: the activations ``[a0 a0 a0 | a1 a1 a1]`` are weighed by the table row
    ``[w0, w1]`` spread to ``[w0 w0 w0 w1 w1 w1]``, then one MatMul with the stacked down projections sums
    ``w0 * down0(a0) + w1 * down1(a1)``.
    """
    table = router(block.gate, x)  # [b, s, experts]
    experts = block.experts
    count, inter = table.shape[-1], experts.down_stacked.shape[0] // table.shape[-1]
    gate, up = torch.matmul(x, experts.up_stacked).chunk(2, dim=-1)  # [b, s, experts * inter] each
    spread = table.index_select(-1, torch.arange(count * inter, dtype=torch.int64) // inter)  # [b, s, e * inter]
    mixed = torch.matmul(experts.act_fn(gate) * up * spread, experts.down_stacked)  # [b, s, hidden]
    shared = getattr(block, "shared_experts", None)
    return mixed if shared is None else mixed + shared(x)
