"""What each model family does differently from Llama: the exporter's :class:`Adapter` table.

One generic KV-explicit wrapper (:mod:`qspec.export.wrapper`) and, per family, the few things that really
differ: projections (Phi-3's fused ``qkv_proj``), q/k norms (per head: Qwen3, Gemma 3; over all heads:
OLMo 2), where the norms sit (OLMo 2's post-norms, Gemma's sandwich), sliding windows, RoPE tables
(Gemma 3's local and global bases), constant factors (Granite's multipliers, Gemma 2's soft-capping),
and whether ONNX Runtime's ``GroupQueryAttention`` can compute the family's attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qspec.errors import UnsupportedModelError
from qspec.export.moe import Router, group_limited, softmax_top_k

# RoPE variants whose frequencies do not depend on the sequence length, so one graph serves all.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _no_window(config, layer_idx: int, attn: nn.Module) -> int | None:
    return None


def _config_window(config, layer_idx: int, attn: nn.Module) -> int | None:
    return getattr(config, "sliding_window", None)


def _layer_window(config, layer_idx: int, attn: nn.Module) -> int | None:
    return getattr(attn, "sliding_window", None)


def _one_rope(rotary: nn.Module, config, layer_idx: int) -> tuple[torch.Tensor, float]:
    return rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))


def _rope_by_layer_type(rotary: nn.Module, config, layer_idx: int) -> tuple[torch.Tensor, float]:
    """Gemma 3: local (sliding) and global layers rotate with RoPE bases of their own."""
    kind = config.layer_types[layer_idx]
    return getattr(rotary, f"{kind}_inv_freq"), float(getattr(rotary, f"{kind}_attention_scaling", 1.0))


@dataclass(frozen=True)
class Scales:
    """Constant factors some families put around the Llama computation (None: not there).

    Read from the config under the names its family gives them: Granite's ``embedding_multiplier``,
    ``residual_multiplier`` and ``logits_scaling`` (logits divided by it), Gemma 2's
    ``attn_logit_softcapping`` and ``final_logit_softcapping`` (``c * tanh(x / c)``)."""

    embedding: float | None = None
    residual: float | None = None
    logits_divisor: float | None = None
    attention_softcap: float | None = None
    final_softcap: float | None = None


def _no_scales(config) -> Scales:
    return Scales()


def _config_scales(config) -> Scales:
    """The :class:`Scales` a config names (only for the families that have them: an EAGLE head's Llama config
    copied from such a target keeps the names, not the computation)."""
    names = {
        "embedding": "embedding_multiplier",
        "residual": "residual_multiplier",
        "logits_divisor": "logits_scaling",
        "attention_softcap": "attn_logit_softcapping",
        "final_softcap": "final_logit_softcapping",
    }
    values = {field: getattr(config, name, None) for field, name in names.items()}
    return Scales(**{field: float(v) for field, v in values.items() if v is not None and float(v) != 1.0})


@dataclass(frozen=True)
class Adapter:
    """What one model family does differently from Llama."""

    family: str
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    window: Callable[..., int | None] = _no_window  # sliding window of a layer, or None
    qk_norm_full: bool = False  # RMSNorm of q and k over all heads, before the head split (OLMo 2)
    fused_qkv: bool = False  # one ``qkv_proj`` projection, q then k then v (Phi-3)
    # "pre": norm before attention and MLP (Llama); "post": after them (OLMo 2); "sandwich": both (Gemma 2/3)
    norms: str = "pre"
    rope: Callable[..., tuple[torch.Tensor, float]] = _one_rope  # a layer's RoPE frequencies and scaling
    scales: Callable[..., Scales] = _no_scales  # constant factors around the computation
    # ONNX Runtime's GroupQueryAttention computes this family's attention (the ort backend fuses it)
    fused_attention: bool = True
    router: Router | None = None  # a mixture-of-experts family's routing (qspec.export.moe)


ADAPTERS: dict[str, Adapter] = {
    "llama": Adapter("llama"),
    "mistral": Adapter("mistral", window=_config_window),
    "qwen2": Adapter("qwen2", window=_layer_window),
    "qwen3": Adapter("qwen3", qk_norm=True, window=_layer_window),
    "phi3": Adapter("phi3", fused_qkv=True, window=_config_window),
    "granite": Adapter("granite", scales=_config_scales),
    "olmo2": Adapter("olmo2", qk_norm_full=True, norms="post"),
    "gemma2": Adapter("gemma2", norms="sandwich", window=_layer_window, scales=_config_scales),
    # GroupQueryAttention takes one RoPE table and plain q/k norm weights; Gemma 3 has two tables and (1 + w) norms
    "gemma3_text": Adapter(
        "gemma3_text",
        qk_norm=True,
        norms="sandwich",
        window=_layer_window,
        rope=_rope_by_layer_type,
        scales=_config_scales,
        fused_attention=False,
    ),
    # mixture of experts: the MLP as every expert weighed by the router (qspec.export.moe)
    "mixtral": Adapter("mixtral", window=_config_window, router=softmax_top_k),
    "qwen3_moe": Adapter("qwen3_moe", qk_norm=True, window=_layer_window, router=softmax_top_k),
    # multi-head latent attention (qspec.export.mla; GroupQueryAttention does not compute it), group-limited
    # routing and shared experts; its first first_k_dense_replace layers have a dense MLP
    "deepseek_v3": Adapter("deepseek_v3", router=group_limited, fused_attention=False),
}


def supported_families() -> str:
    return ", ".join(sorted(ADAPTERS))


def adapter_for(config) -> Adapter:
    """The adapter of ``config``'s family, or an error naming what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        archs = ", ".join(getattr(config, "architectures", None) or []) or model_type
        raise UnsupportedModelError(
            f"model type '{model_type}' ({archs}) is not supported; supported: {supported_families()}"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type '{rope_type}' changes with the sequence length and cannot be compiled to static "
            f"shapes; supported RoPE types: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return ADAPTERS[model_type]


def attention_info(model: nn.Module):
    """The :class:`~qspec.package.AttentionInfo` of a Hugging Face decoder: what a fused-attention
    runtime needs beside the weights (RoPE table, heads, scale, windows, q/k norm)."""
    from qspec.package import AttentionInfo

    config = model.config
    adapter = adapter_for(config)
    if not adapter.fused_attention:
        return None  # the runtime graph keeps the exported attention
    layers = model.model.layers
    attn = layers[0].self_attn
    inv_freq, rope_scaling = adapter.rope(model.model.rotary_emb, config, 0)
    if 2 * len(inv_freq) < attn.head_dim and len(inv_freq) % 8:
        return None  # partial rotary: the op rotates a multiple of 16 features only
    norm = getattr(attn, "q_norm", None) if adapter.qk_norm or adapter.qk_norm_full else None
    return AttentionInfo(
        num_layers=len(layers),
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim,
        scale=float(attn.scaling),
        windows=[adapter.window(config, i, layer.self_attn) for i, layer in enumerate(layers)],
        qk_norm=adapter.qk_norm,
        qk_norm_full=adapter.qk_norm_full,
        softcap=adapter.scales(config).attention_softcap or 0.0,
        qk_norm_eps=float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))) if norm is not None else 1e-6,
        inv_freq=[float(f) for f in inv_freq.detach().float()],
        rope_scaling=rope_scaling,
    )
