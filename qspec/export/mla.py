"""DeepSeek-V3's multi-head latent attention (MLA) with its KV cache held as QEfficient holds it compressed.

Queries come through a low-rank ``q_a_proj`` -> RMSNorm -> ``q_b_proj`` (or one ``q_proj``); keys and values
from one latent: ``kv_a_proj_with_mqa`` gives a ``kv_lora_rank`` latent ``c`` and a ``qk_rope_head_dim`` key part
shared by every head; ``kv_b_proj`` expands the normed latent into each head's key part without position
(``k_nope = K_h c``, ``qk_nope_head_dim`` wide) and its value (``v = V_h c``, ``v_head_dim`` wide). A head's key
is ``[k_nope, rope(k_rot)]``.

The cache, as QEfficient's ``cache_compressed`` export holds it: ``compressed_kv.{i}``
``[batch, 1, ctx_len, kv_lora_rank]`` (the normed latent) and ``k_pe.{i}`` ``[batch, 1, ctx_len, qk_rope_head_dim]``
(the shared key part, RoPE applied), one entry per token for all heads. ``kv_b_proj`` is absorbed, as QEfficient's
``absorption`` does: a head's score is ``q_nope . K_h c + q_rot . k_pe = (K_h^T q_nope) . c + q_rot . k_pe``, so
the query is carried into the latent space (``K_h^T q_nope``, ``kv_lora_rank`` wide) and attention reads the
latents themselves; its output ``sum_j p_j V_h c_j = V_h (sum_j p_j c_j)`` expands the attended latent once per
query token, not every cached token per call. (QEfficient folds ``q_b_proj``'s nope rows and ``K_h`` into one
``[q_lora_rank, kv_lora_rank]`` matrix per head; here the query goes through ``q_b_proj`` then ``K_h^T``: the same
product in fewer multiply-adds when ``qk_nope_head_dim < kv_lora_rank``, and no weight the checkpoint lacks.)

Example, DeepSeek-V3 (128 heads, kv_lora_rank 512, rope 64, nope 128, values 128): a token's cache per layer
is ``512 + 64 = 576`` numbers instead of ``128 * (192 + 128) = 40,960`` (71x fewer).
"""

from __future__ import annotations

import torch
from torch import nn


def is_latent(attn: nn.Module) -> bool:
    """A DeepSeek-style MLA block (``kv_a_proj_with_mqa``)."""
    return hasattr(attn, "kv_a_proj_with_mqa")


def cache_dims(attn: nn.Module) -> tuple[int, int]:
    """(latent width, rotated key width): the last dimension of ``compressed_kv.{i}`` and ``k_pe.{i}``."""
    return attn.kv_lora_rank, attn.qk_rope_head_dim


def expanded_dims(attn: nn.Module) -> tuple[int, int]:
    """(key width, value width) of one head's entry in the expanded per-head cache (what the compressed one
    replaces; the bench's cache-size comparison)."""
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


def latent_states(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool):
    """``q_nope [b, heads, s, nope]``, ``q_rot [b, heads, s, rope]`` (rotated), and what the cache holds of ``x``
    ``[b, s, hidden]``: ``latent [b, 1, s, kv_lora_rank]`` (normed) and ``k_rot [b, 1, s, rope]`` (rotated).
    ``cos``, ``sin`` ``[b, 1, s, rope]``."""
    batch, seq, _ = x.shape
    heads, nope, rot = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q_nope, q_rot = q.view(batch, seq, heads, nope + rot).transpose(1, 2).split([nope, rot], dim=-1)
    latent, k_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rot], dim=-1)
    rope = _rope_interleaved if interleave else _rope_halves
    latent = attn.kv_a_layernorm(latent)[:, None]  # [b, 1, s, kv_lora_rank]: one latent for every head
    return q_nope, rope(q_rot, cos, sin), latent, rope(k_rot[:, None], cos, sin)


def expanded_qkv(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool):
    """The expanded form (QEfficient's default, ``cache_compressed`` off; qspec's MTP head): q, k
    ``[b, heads, s, nope + rope]`` and v ``[b, heads, s, v_head_dim]``, every head's key and value cached."""
    batch, seq, _ = x.shape
    q_nope, q_rot, latent, k_rot = latent_states(attn, x, cos, sin, interleave=interleave)
    kv = attn.kv_b_proj(latent[:, 0]).view(batch, seq, attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim)
    k_nope, v = kv.transpose(1, 2).split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_rot.expand(-1, attn.num_heads, -1, -1)), dim=-1)
    return torch.cat((q_nope, q_rot), dim=-1), k, v


def _absorbed(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj`` per head, as the absorbed attention multiplies by it: ``K_h^T`` ``[heads, nope, kv_lora_rank]``
    (carries a query into the latent space) and ``V_h^T`` ``[heads, kv_lora_rank, v_head_dim]`` (expands an attended
    latent into the head's value). Views of the projection's own weight (held ``[in, out]`` or ``[out, in]``)."""
    proj = attn.kv_b_proj
    weight = proj.weight.t() if type(proj) is nn.Linear else proj.weight  # [kv_lora_rank, heads * (nope + v)]
    per_head = weight.reshape(attn.kv_lora_rank, attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim)
    k_up, v_up = per_head.split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)  # [r, heads, nope or v]
    return k_up.permute(1, 2, 0), v_up.transpose(0, 1)


def latent_attention(attn, q_nope, q_rot, latents, rope_keys, visible) -> torch.Tensor:
    """The heads' attention over the cached ``latents [b, 1, n, kv_lora_rank]`` and ``rope_keys [b, 1, n, rope]``
    with ``kv_b_proj`` absorbed, through ``o_proj``: ``[b, s, hidden]``. ``visible [b, 1, s, n]``."""
    batch, heads, seq, _ = q_nope.shape
    k_up, v_up = _absorbed(attn)
    q_latent = torch.matmul(q_nope, k_up.to(q_nope.dtype))  # [b, heads, s, kv_lora_rank]
    scores = torch.matmul(q_latent, latents.transpose(-1, -2)) + torch.matmul(q_rot, rope_keys.transpose(-1, -2))
    scores = (scores * attn.scaling).masked_fill(~visible, torch.finfo(scores.dtype).min)  # [b, heads, s, n]
    probs = torch.softmax(scores.float(), dim=-1).to(q_nope.dtype)
    attended = torch.matmul(probs, latents)  # [b, heads, s, kv_lora_rank]
    out = torch.matmul(attended, v_up.to(q_nope.dtype))  # [b, heads, s, v_head_dim]
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, heads * attn.v_head_dim))
