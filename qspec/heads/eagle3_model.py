"""The EAGLE-3 draft head as trained here, in the layout vLLM's ``llama_eagle3.py`` and SpecForge load.

Tensors (``H`` hidden, ``A`` = heads x head_dim, ``Kv`` = kv heads x head_dim, ``I`` MLP width)::

    fc.weight                               [H, 3H]   over cat(tap_0, tap_1, tap_2)
    midlayer.input_layernorm.weight         [H]       on embed(token)
    midlayer.hidden_norm.weight             [H]       on the feature
    midlayer.self_attn.q_proj.weight        [A, 2H]   q/k/v read cat(input_layernorm(e), hidden_norm(f))
    midlayer.self_attn.k_proj.weight        [Kv, 2H]
    midlayer.self_attn.v_proj.weight        [Kv, 2H]
    midlayer.self_attn.o_proj.weight        [H, A]
    midlayer.post_attention_layernorm.weight [H]
    midlayer.mlp.{gate,up}_proj.weight      [I, H],  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                             [H]
    lm_head.weight                          [draft_vocab_size, H]
    d2t [draft_vocab_size] int64 (target id = draft id + d2t[draft id]), t2d [vocab] bool

One step (vLLM's decoder layer, ``norm_before_residual`` false): ``residual = f``;
``x = attn(cat(input_layernorm(embed(tok)), hidden_norm(f)))``; ``residual = x + residual``;
``x = mlp(post_attention_layernorm(residual))``; ``prenorm = x + residual``; logits =
``lm_head(norm(prenorm))``. The first step's feature is ``fc(cat(taps))``; a chained step's is the
previous step's ``prenorm``. The target's embedding is frozen and not saved.

**Training-time test** (EAGLE-3; SpecForge's ``OnlineEagle3Model``): step ``j`` of the unroll runs every
row ``t`` at once at position ``t + j``; its query sees the step-0 keys of rows ``0..t`` (the true prefix)
and the keys of steps ``1..j`` at row ``t`` only (its own chain): :func:`ttt_mask`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qspec.common import with_umask
from qspec.heads.checkpoint import d2t_from_ids, t2d_from_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, hidden: int, inner: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, inner)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half) of ``x [B, heads, T, d]`` at ``positions [B, T]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[..., None] * inv  # [B, T, d/2]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None].to(x.dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None].to(x.dtype)
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def ttt_mask(length: int, step: int) -> torch.Tensor:
    """``[T, (step + 1) T]`` bool: which keys the queries of unroll step ``step`` see. Block 0 (the step-0
    keys) is causal, blocks ``1..step`` (the chained steps' keys) are diagonal. Example, T = 3, step 1::

        1 0 0 | 1 0 0
        1 1 0 | 0 1 0
        1 1 1 | 0 0 1
    """
    eye = torch.eye(length, dtype=torch.bool)
    return torch.cat([torch.ones(length, length, dtype=torch.bool).tril()] + [eye] * step, 1)


class Eagle3Head(nn.Module):
    """EAGLE-3 head over a Llama-like target: ``project(taps)``, then :meth:`step` per unroll step."""

    def __init__(self, config: dict, embed_tokens: torch.Tensor, draft_ids: torch.Tensor):
        super().__init__()
        self.config = dict(config)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        self.theta = float(config.get("rope_theta", 10000.0))
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.detach().float().clone(), freeze=True)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = MidLayer(
            hidden,
            config["intermediate_size"],
            heads,
            config["num_key_value_heads"],
            head_dim,
            config["rms_norm_eps"],
        )
        self.norm = RMSNorm(hidden, config["rms_norm_eps"])
        self.lm_head = nn.Linear(hidden, len(draft_ids), bias=False)
        self.register_buffer("draft_ids", torch.as_tensor(draft_ids, dtype=torch.long), persistent=False)

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """``[B, T, 3, H]`` taps -> ``[B, T, H]`` first-step features (``fc`` over their concatenation)."""
        return self.fc(taps.flatten(-2).to(self.fc.weight.dtype))

    def step(self, input_ids, feature, positions, cache: list, mask: torch.Tensor):
        """One step over all rows: ``(prenorm [B, T, H], logits [B, T, draft_vocab])``. Appends this step's
        keys and values to ``cache``; ``mask [T, len(cache) * T]`` says which cached keys each row sees."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        b, t, _ = feature.shape
        x = torch.cat((layer.input_layernorm(self.embed_tokens(input_ids)), layer.hidden_norm(feature)), -1)

        def split(proj, n):
            return proj(x).view(b, t, n, attn.head_dim).transpose(1, 2)

        q = rope(split(attn.q_proj, attn.heads), positions, self.theta)
        k = rope(split(attn.k_proj, attn.kv_heads), positions, self.theta)
        cache.append((k, split(attn.v_proj, attn.kv_heads)))
        keys = torch.cat([c[0] for c in cache], 2).repeat_interleave(attn.heads // attn.kv_heads, 1)
        values = torch.cat([c[1] for c in cache], 2).repeat_interleave(attn.heads // attn.kv_heads, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        residual = attn.o_proj(out.transpose(1, 2).reshape(b, t, -1)) + feature
        prenorm = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return prenorm, self.lm_head(self.norm(prenorm))

    def unroll(self, input_ids: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: ``steps`` logits ``[B, T, draft_vocab]``. Step ``j`` at row ``t`` reads token
        ``input_ids[t + j]`` (shifted in with 0 past the end) at position ``t + j``, with step ``j - 1``'s
        output at row ``t`` as its feature (``fc(taps[t])`` for step 0); it drafts the token after it."""
        b, t = input_ids.shape
        positions = torch.arange(t).expand(b, t)
        feature, cache, out = self.project(taps), [], []
        for j in range(steps):
            ids = F.pad(input_ids[:, j:], (0, j))
            feature, logits = self.step(ids, feature, positions + j, cache, ttt_mask(t, j))
            out.append(logits)
        return out

    def to_target(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        return self.draft_ids[draft_tokens]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if not name.startswith("embed_tokens.")]


def head_config(target_config, draft_vocab_size: int, taps: tuple[int, ...]) -> dict:
    """The head's ``config.json`` values from the target's HF config (SpecForge's keys, no machine paths)."""
    c = target_config
    rope_theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta")
    heads = c.num_attention_heads
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": float(rope_theta or 10000.0),
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": getattr(c, "pad_token_id", None),
        "torch_dtype": "float16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(taps), "use_aux_hidden_state": True},
    }


def head_from_target(target_model, draft_ids: torch.Tensor, taps: tuple[int, ...], *, init: str = "lens") -> Eagle3Head:
    """A fresh head for ``target_model``: its frozen embedding; ``lm_head`` starts from the target's LM-head
    rows of the draft vocabulary. ``init="lens"`` starts as the target's logit lens at the last tap: ``fc``
    picks tap 2, the midlayer's output projections are zero (so ``prenorm`` is that tap) and ``norm`` is the
    target's final norm, so the untrained head already drafts ``argmax(lm_head(norm(h_{L-3})))``;
    ``init="random"`` is SpecForge's (random ``fc`` and midlayer)."""
    config = head_config(target_model.config, len(draft_ids), taps)
    head = Eagle3Head(config, target_model.get_input_embeddings().weight, draft_ids)
    hidden = config["hidden_size"]
    with torch.no_grad():
        head.lm_head.weight.copy_(target_model.get_output_embeddings().weight[draft_ids].float())
        nn.init.normal_(head.fc.weight, std=1.0 / math.sqrt(3 * hidden))
        if init == "lens":
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * hidden :] = torch.eye(hidden)
            head.midlayer.self_attn.o_proj.weight.zero_()
            head.midlayer.mlp.down_proj.weight.zero_()
            head.norm.weight.copy_(target_model.model.norm.weight.float())
    return head


def save_head(head: Eagle3Head, folder: Path, *, dtype: torch.dtype = torch.float16) -> Path:
    """``config.json`` and ``model.safetensors`` (fp16, ``d2t`` / ``t2d`` beside), without the target's
    embedding."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to(dtype).contiguous()
        for name, tensor in head.state_dict().items()
        if not name.startswith("embed_tokens.")
    }
    tensors["d2t"] = d2t_from_ids(head.draft_ids)
    tensors["t2d"] = t2d_from_ids(head.draft_ids, head.config["vocab_size"])
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    with_umask(folder / WEIGHTS, 0o666)
    (folder / CONFIG).write_text(json.dumps(head.config, indent=2) + "\n")
    return folder


def load_trained(folder: Path, embed_tokens: torch.Tensor) -> Eagle3Head:
    """A head written by :func:`save_head` (fp32), with the target's ``embed_tokens``."""
    from safetensors.torch import load_file

    config = json.loads((folder / CONFIG).read_text())
    tensors = load_file(str(folder / WEIGHTS))
    d2t = tensors.pop("d2t")
    tensors.pop("t2d")
    head = Eagle3Head(config, embed_tokens, torch.arange(len(d2t)) + d2t)
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return head.eval()
