"""DeepSeek-V3's multi-head latent attention (MLA) with its KV cache held as QEfficient holds it by default.

Queries come through a low-rank ``q_a_proj`` -> RMSNorm -> ``q_b_proj`` (or one ``q_proj``); keys and values
from one latent: ``kv_a_proj_with_mqa`` gives a ``kv_lora_rank`` latent and a ``qk_rope_head_dim`` key part
shared by every head; ``kv_b_proj`` expands the normed latent into each head's key part without position
(``qk_nope_head_dim``) and its value (``v_head_dim``). A head's key is ``[k_nope, rope(k_rot)]``.

The cache, as QEfficient's default export (``mla_absorption`` off) holds it: ``past_key.{i}``
``[batch, num_heads, ctx_len, qk_nope_head_dim + qk_rope_head_dim]`` (RoPE applied) and ``past_value.{i}``
``[batch, num_heads, ctx_len, v_head_dim]``: the contract's names and the usual attention over them. (Its
``cache_compressed`` variant keeps the latent and the rotated shared key instead; not exported here.)
"""

from __future__ import annotations

import torch
from torch import nn


def is_latent(attn: nn.Module) -> bool:
    """A DeepSeek-style MLA block (``kv_a_proj_with_mqa``)."""
    return hasattr(attn, "kv_a_proj_with_mqa")


def kv_dims(attn: nn.Module) -> tuple[int, int]:
    """(key width, value width) of one head's cache entry."""
    return attn.qk_nope_head_dim + attn.qk_rope_head_dim, attn.v_head_dim


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's ``rope_interleave``), output de-interleaved as
    transformers writes it: ``[x_even * c - x_odd * s, x_odd * c + x_even * s]``."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def _rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def latent_qkv(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool):
    """q, k ``[batch, heads, seq, qk_nope + qk_rope]`` and v ``[batch, heads, seq, v_head_dim]`` of ``x``
    ``[batch, seq, hidden]``; ``cos``, ``sin`` ``[batch, 1, seq, qk_rope]``."""
    batch, seq, _ = x.shape
    heads, nope, rot = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(batch, seq, heads, nope + rot).transpose(1, 2)
    q_pass, q_rot = q.split([nope, rot], dim=-1)
    latent, k_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rot], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(batch, seq, heads, nope + attn.v_head_dim).transpose(1, 2)
    k_pass, v = kv.split([nope, attn.v_head_dim], dim=-1)
    k_rot = k_rot[:, None]  # [batch, 1, seq, rot]: one rotated key part for every head
    rope = _rope_interleaved if interleave else _rope_halves
    q_rot, k_rot = rope(q_rot, cos, sin), rope(k_rot, cos, sin)
    k = torch.cat((k_pass, k_rot.repeat(1, heads, 1, 1)), dim=-1)
    return torch.cat((q_pass, q_rot), dim=-1), k, v
