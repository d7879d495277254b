"""Mixture-of-experts MLPs in static shapes, as QEfficient exports them: every expert runs on every token.

transformers' MoE blocks (Mixtral, Qwen3-MoE) send each token to its top-k experts with data-dependent
gathers and a loop over the experts hit, which a statically compiled graph cannot hold. Here the block's
own router picks the top-k experts and their weights (normalised or not, as the family's router does), the
weights are scattered to a dense ``[tokens, experts]`` table (zero off the top-k), and every expert's MLP
runs on every token from the block's stacked ``[experts, ...]`` weights (two einsums); the table weighs and
sums their outputs. Same result (a token's sum over its top-k experts; the other terms are exact zeros),
static shapes, ``num_experts / top_k`` times the MLP's arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn


def is_moe(mlp: nn.Module) -> bool:
    """A transformers MoE block with a top-k router (``gate``) and stacked experts (``experts.gate_up_proj``)."""
    return hasattr(mlp, "experts") and hasattr(mlp.experts, "gate_up_proj") and hasattr(mlp, "gate")


def static_moe(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block`` (a MoE block, :func:`is_moe`) on ``x`` ``[batch, seq, hidden]`` with every expert computed.

    Example, 4 experts, top 2: a token routed to experts 3 and 0 with weights 0.7, 0.3 gets the table row
    ``[0.3, 0, 0, 0.7]``: its output is ``0.3 * e0(x) + 0.7 * e3(x)``, experts 1 and 2 weighted by zero.
    """
    batch, seq, hidden = x.shape
    flat = x.reshape(-1, hidden)  # [tokens, hidden]
    _, weights, chosen = block.gate(flat)  # [tokens, top_k] each
    experts = block.experts
    table = torch.zeros(flat.shape[0], experts.gate_up_proj.shape[0], dtype=weights.dtype)
    table = table.scatter(1, chosen, weights).to(flat.dtype)  # [tokens, experts]
    gate_up = torch.einsum("th,eih->tei", flat, experts.gate_up_proj)  # [tokens, experts, 2 * inter]
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.einsum("tei,ehi->teh", experts.act_fn(gate) * up, experts.down_proj)  # [tokens, experts, hidden]
    return (out * table[..., None]).sum(dim=1).reshape(batch, seq, hidden)
