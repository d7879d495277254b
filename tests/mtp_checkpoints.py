"""Tiny targets whose checkpoints ship MTP layers under the standard names, and a reference forward of one MTP
layer written from vLLM's ``deepseek_mtp.py`` / ``mimo_mtp.py`` with plain tensor ops (no transformers module)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.conftest import byte_tokenizer, tiny_config


def save_mtp_model(
    folder: Path, layout: str, *, num_mtp: int, family: str = "llama", seed: int = 0, predictive: bool = False
) -> Path:
    """A tiny random ``family`` target (2 layers) plus ``num_mtp`` MTP layers, saved as a model folder.

    ``layout`` ``deepseek``: ``model.layers.{2+i}.{enorm, hnorm, eh_proj, shared_head.*, embed_tokens}`` + a block,
    config ``num_nextn_predict_layers``. ``mimo``: a Qwen2 with ``model.mtp_layers.{i}.*``, ``model_type: mimo``.

    ``predictive``: the target's layers add nothing to the residual stream (zero ``o_proj``/``down_proj``), so
    its next greedy token is a function of the current one, ``g(x)``; the even MTP layers compute ``g`` of their
    token exactly (projection onto the embedding, a block that adds nothing, the target's final norm and LM head),
    so their drafts are accepted; the odd ones stay random, so theirs mostly are not.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, tie=False)
    model = AutoModelForCausalLM.from_config(config)
    tensors = {}
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.3)
        tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
        layers, hidden = config.num_hidden_layers, config.hidden_size
        block = {k.removeprefix("model.layers.0."): v for k, v in tensors.items() if k.startswith("model.layers.0.")}
        for i in range(num_mtp):
            prefix = f"model.layers.{layers + i}." if layout == "deepseek" else f"model.mtp_layers.{i}."
            for name, value in block.items():
                scale = 0.3 if value.dim() > 1 else 0.1
                base = torch.ones_like(value) if name.endswith("norm.weight") else torch.zeros_like(value)
                tensors[prefix + name] = (base + torch.randn_like(value) * scale).contiguous()
            own = (
                {"enorm": (hidden,), "hnorm": (hidden,), "eh_proj": (hidden, 2 * hidden)}
                | {"shared_head.norm": (hidden,), "shared_head.head": (config.vocab_size, hidden)}
                if layout == "deepseek"
                else {
                    "token_layernorm": (hidden,),
                    "hidden_layernorm": (hidden,),
                    "input_proj": (hidden, 2 * hidden),
                    "final_layernorm": (hidden,),
                }
            )
            for name, shape in own.items():
                value = 1 + 0.1 * torch.randn(shape) if len(shape) == 1 else 0.3 * torch.randn(shape)
                tensors[f"{prefix}{name}.weight"] = value.contiguous()
            if layout == "deepseek":
                tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
            if predictive and i % 2 == 0:
                _predict_next(tensors, prefix, layout, hidden)
        if predictive:
            for name in tensors:
                if name.startswith("model.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
                    tensors[name] = torch.zeros_like(tensors[name])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    values = config.to_dict() | {"num_nextn_predict_layers": num_mtp}
    if layout == "mimo":
        values |= {"model_type": "mimo", "architectures": ["MiMoForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(values, indent=2))
    byte_tokenizer().save_pretrained(folder)
    return folder


def _predict_next(tensors: dict, prefix: str, layout: str, hidden: int) -> None:
    """MTP layer ``prefix`` returns the target's logits for its token alone (see ``predictive``)."""
    eye, zero = torch.eye(hidden), torch.zeros(hidden, hidden)
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        tensors[prefix + name] = torch.zeros_like(tensors[prefix + name])
    final_norm = tensors["model.norm.weight"].clone()
    if layout == "deepseek":  # eh_proj over cat(enorm(e), hnorm(h)): keep e
        tensors |= {prefix + "eh_proj.weight": torch.cat((eye, zero), 1), prefix + "enorm.weight": torch.ones(hidden)}
        tensors |= {
            prefix + "shared_head.norm.weight": final_norm,
            prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        }
    else:  # input_proj over cat(hidden_ln(h), token_ln(e)): keep e
        tensors |= {
            prefix + "input_proj.weight": torch.cat((zero, eye), 1),
            prefix + "token_layernorm.weight": torch.ones(hidden),
        }
        tensors[prefix + "final_layernorm.weight"] = final_norm


# Reference forward ---------------------------------------------------------------------------------------


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[..., None].float() * inv  # [B, T, dim/2]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def _linear(w, prefix, name, x):
    y = x @ w[f"{prefix}{name}.weight"].T
    bias = w.get(f"{prefix}{name}.bias")
    return y if bias is None else y + bias


def reference_block(w, prefix, config, x, positions):
    """A Llama/Qwen2 decoder layer over ``x`` [B, T, H], causal attention over its own ``T`` steps."""
    eps, heads, kv_heads = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    b, t, _ = x.shape
    h = _rms(x, w[f"{prefix}input_layernorm.weight"], eps)
    q = _linear(w, prefix, "self_attn.q_proj", h).view(b, t, heads, dim).transpose(1, 2)
    k = _linear(w, prefix, "self_attn.k_proj", h).view(b, t, kv_heads, dim).transpose(1, 2)
    v = _linear(w, prefix, "self_attn.v_proj", h).view(b, t, kv_heads, dim).transpose(1, 2)
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dim)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, heads * dim)
    x = x + _linear(w, prefix, "self_attn.o_proj", out)
    h = _rms(x, w[f"{prefix}post_attention_layernorm.weight"], eps)
    gate, up = _linear(w, prefix, "mlp.gate_proj", h), _linear(w, prefix, "mlp.up_proj", h)
    return x + _linear(w, prefix, "mlp.down_proj", torch.nn.functional.silu(gate) * up)


def reference_mtp(folder: Path, layout: str, layer: int, input_ids, hidden, positions):
    """``(chained feature, logits)`` of MTP layer ``layer`` as vLLM computes them: embeds zeroed at position 0,
    ``deepseek``: eh_proj(cat(enorm(e), hnorm(h))) -> block -> feature; logits shared_head.head(shared_head.norm);
    ``mimo``: input_proj(cat(hidden_ln(h), token_ln(e))) -> block -> final_layernorm = feature; logits lm_head."""
    from safetensors.torch import load_file

    w = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    eps = config["rms_norm_eps"]
    embeds = w["model.embed_tokens.weight"][input_ids]
    embeds = torch.where((positions == 0)[..., None], torch.zeros_like(embeds), embeds)
    if layout == "deepseek":
        p = f"model.layers.{config['num_hidden_layers'] + layer}."
        embeds = w[f"model.layers.{config['num_hidden_layers']}.embed_tokens.weight"][input_ids]
        embeds = torch.where((positions == 0)[..., None], torch.zeros_like(embeds), embeds)
        x = torch.cat((_rms(embeds, w[p + "enorm.weight"], eps), _rms(hidden, w[p + "hnorm.weight"], eps)), -1)
        y = reference_block(w, p, config, x @ w[p + "eh_proj.weight"].T, positions)
        return y, _rms(y, w[p + "shared_head.norm.weight"], eps) @ w[p + "shared_head.head.weight"].T
    p = f"model.mtp_layers.{layer}."
    x = torch.cat(
        (_rms(hidden, w[p + "hidden_layernorm.weight"], eps), _rms(embeds, w[p + "token_layernorm.weight"], eps)), -1
    )
    y = _rms(
        reference_block(w, p, config, x @ w[p + "input_proj.weight"].T, positions), w[p + "final_layernorm.weight"], eps
    )
    return y, y @ w["lm_head.weight"].T
