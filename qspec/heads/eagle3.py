"""EAGLE-3 as users bring it: vLLM's ``llama_eagle3.py`` / SpecForge layout and the ``speculators`` format, the
torch module, and its :class:`~qspec.heads.kind.HeadKind`.

The target hands the head ``fc(cat(r_a, r_b, r_c))``: its residual stream entering layers ``a < b < c``
(``eagle_config.eagle_aux_hidden_state_layer_ids``, else vLLM's ``(2, L // 2, L - 3)``), mapped by the head's
``fc`` [H, 3H]. qspec folds ``fc`` into the target graph (:meth:`Eagle3Kind.taps`), so the package's
``hidden_states`` stays ``[B, S, H]`` and the head graph has EAGLE-1's inputs and outputs. One step, as vLLM
runs it (feature ``f``, token embedding ``e``)::

    h = hidden_norm(f);  residual = h if norm_before_residual else f
    x = residual + attn(cat(input_layernorm(e), h))          # q/k/v read 2H
    out = x + mlp(post_attention_layernorm(x))               # the chained feature (pre-norm)
    logits = lm_head(norm(out))                              # draft vocabulary; target id = d + d2t[d]

Layouts read (names after an optional ``model.`` prefix):

=================  ===========================================  ============================================
                   vLLM / SpecForge                             speculators (``speculators_model_type``)
=================  ===========================================  ============================================
config             ``architectures: [LlamaForCausalLMEagle3]``  ``eagle3``, ``transformer_layer_config``
layer              ``midlayer.*``                               ``layers.0.*``
taps               ``eagle_config.eagle_aux_hidden_state_...``  ``eagle_aux_hidden_state_layer_ids``
=================  ===========================================  ============================================

Both: ``fc.weight`` [H, 3H], ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` (int64 offsets),
``t2d`` (bool mask), optional ``embed_tokens.weight`` (else the target's), ``norm_before_residual``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from qspec.common import with_umask
from qspec.errors import ConfigError, ModelLoadError
from qspec.heads.checkpoint import (
    check_draft_ids,
    clean_config,
    d2t_from_ids,
    draft_rows,
    frozen_linear,
    ids_from_d2t,
    load_exact,
    read_json,
    read_weights,
    t2d_from_ids,
)
from qspec.heads.eagle import EagleKind
from qspec.heads.kind import TargetTaps, TracedHead
from qspec.specializations import SpecializationConfig

EAGLE3_CONFIG = "config.json"
EAGLE3_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# speculators' options that change the computation and qspec does not run
UNSUPPORTED_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")


class Eagle3Head(nn.Module):
    """EAGLE-3 draft head: ``forward(input_ids, feature, position_ids) -> pre-norm features``, ``logits(features)``.

    ``config``: a one-layer ``LlamaConfig``. ``fc`` [H, n * H] is the target side's (folded into the target
    graph); ``aux_layer_ids``: the taps the head's config names (None: vLLM's default).
    """

    def __init__(
        self,
        config,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        *,
        draft_ids: torch.Tensor | None = None,
        num_taps: int = 3,
        aux_layer_ids: tuple[int, ...] | None = None,
        norm_before_residual: bool = False,
    ):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        if config.num_hidden_layers != 1:
            raise ConfigError(f"qspec runs one-layer EAGLE-3 heads; this config says {config.num_hidden_layers}")
        hidden = config.hidden_size
        if embed_tokens.shape[1] != hidden or lm_head.shape[1] != hidden:
            raise ConfigError(f"the EAGLE-3 head's hidden_size {hidden} differs from its tables' width; use its target")
        config = copy.deepcopy(config)
        config._attn_implementation = "eager"
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.detach().float().clone(), freeze=True)
        self.fc = nn.Linear(num_taps * hidden, hidden, bias=False)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        attn, heads = layer.self_attn, config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        attn.q_proj = nn.Linear(2 * hidden, heads * attn.head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * attn.head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * attn.head_dim, bias=bias)
        layer.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([layer])
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        ids = check_draft_ids(draft_ids, embed_tokens.shape[0])
        if ids is None and lm_head.shape[0] != embed_tokens.shape[0]:
            raise ConfigError(
                f"the LM head has {lm_head.shape[0]} rows and the vocabulary {embed_tokens.shape[0]}; "
                "a reduced draft vocabulary needs its d2t table"
            )
        self.lm_head = frozen_linear(draft_rows(lm_head, ids))
        self.register_buffer("draft_ids", ids, persistent=False)
        self.aux_layer_ids = tuple(aux_layer_ids) if aux_layer_ids is not None else None
        self.norm_before_residual = norm_before_residual
        self.own_embed = False  # the checkpoint holds embed_tokens (saved back with it)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        """The taps for a target of ``num_layers`` layers, ascending as vLLM collects them."""
        from qspec.export.graph import VLLM_TAPS, tap_layers

        return tap_layers(self.aux_layer_ids if self.aux_layer_ids is not None else VLLM_TAPS, num_layers)

    def combine(self, taps: list[torch.Tensor]) -> torch.Tensor:
        """``fc(cat(taps))``: the feature the target hands the head (what the target graph computes)."""
        return self.fc(torch.cat(taps, dim=-1))

    def step_input(self, embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual, attention input [.., 2H])`` of the layer: vLLM's first-layer prologue."""
        layer = self.layers[0]
        normed = layer.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        return residual, torch.cat((layer.input_layernorm(embeds), normed), dim=-1)

    def forward(self, input_ids: torch.Tensor, feature: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced pre-norm features ``[B, T, H]``: causal attention over the ``T`` steps."""
        layer = self.layers[0]
        residual, x = self.step_input(self.embed_tokens(input_ids), feature.to(self.fc.weight.dtype))
        steps = input_ids.shape[1]
        causal = torch.ones(steps, steps, dtype=torch.bool, device=x.device).tril()
        mask = torch.zeros(steps, steps, dtype=x.dtype, device=x.device).masked_fill(~causal, torch.finfo(x.dtype).min)
        cos_sin = self.rotary_emb(residual, position_ids)
        attn, _ = layer.self_attn(x, position_embeddings=cos_sin, attention_mask=mask[None, None])
        hidden = residual + attn
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, T, draft_vocab]`` from pre-norm features."""
        return self.lm_head(self.norm(features))

    def to_target(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        return draft_tokens if self.draft_ids is None else self.draft_ids[draft_tokens]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """``fc``, the layer and ``norm``; the embedding and LM head stay as loaded."""
        return [p for name, p in self.named_parameters() if not name.startswith(("embed_tokens.", "lm_head."))]


# Checkpoints ------------------------------------------------------------------------------------------


def save_eagle3(head: Eagle3Head, out_dir: str | Path, *, dtype: torch.dtype = torch.float16) -> Path:
    """vLLM's / SpecForge's layout: ``config.json`` (``LlamaForCausalLMEagle3``, ``draft_vocab_size``,
    ``eagle_config``) and ``model.safetensors`` with ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``,
    ``t2d`` (and ``embed_tokens`` when the head has its own). Returns ``out_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in head.state_dict().items():
        if name == "embed_tokens.weight" and not head.own_embed:
            continue
        tensors[name.replace("layers.0.", "midlayer.", 1)] = tensor.detach().to(dtype).contiguous()
    vocab = head.embed_tokens.weight.shape[0]
    ids = head.draft_ids if head.draft_ids is not None else torch.arange(vocab)
    tensors["d2t"] = d2t_from_ids(ids)
    tensors["t2d"] = t2d_from_ids(ids, vocab)
    save_file(tensors, str(out / EAGLE3_WEIGHTS[0]), metadata={"format": "pt"})
    with_umask(out / EAGLE3_WEIGHTS[0], 0o666)  # safetensors writes 0600
    values = clean_config(head.config.to_dict())  # no machine path, no transformers boilerplate
    values.update(
        architectures=[ARCHITECTURES[0]],
        model_type="llama",
        num_hidden_layers=1,
        vocab_size=vocab,
        draft_vocab_size=head.draft_vocab_size,
        norm_before_residual=head.norm_before_residual,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    if head.aux_layer_ids is not None:
        values["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(head.aux_layer_ids)}
    rope = values.get("rope_parameters") or {}
    if "rope_theta" not in values and "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    (out / EAGLE3_CONFIG).write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    return out


def is_eagle3_config(config: dict | None) -> bool:
    """vLLM's / SpecForge's architecture name, or the speculators format's ``eagle3``."""
    if not config:
        return False
    return config.get("speculators_model_type") == "eagle3" or any(
        arch in ARCHITECTURES for arch in config.get("architectures") or []
    )


def _read_config(folder: Path, values: dict) -> tuple[dict, dict]:
    """``(layer config, EAGLE-3 options)`` of either format."""
    if "speculators_model_type" in values:
        bad = [name for name in UNSUPPORTED_OPTIONS if values.get(name)]
        if bad:
            raise ModelLoadError(f"{folder} sets {', '.join(bad)}; qspec runs EAGLE-3 heads without them")
        layer = dict(values.get("transformer_layer_config") or {})
        ids = values.get("eagle_aux_hidden_state_layer_ids")
    else:
        layer = dict(values)
        ids = (values.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layer.get("model_type", "llama") not in ("llama", "qwen3", "qwen2"):
        raise ModelLoadError(f"{folder}'s EAGLE-3 layer is {layer.get('model_type')}; qspec reads Llama layers")
    target = values.get("target_hidden_size")
    if target is not None and target != layer.get("hidden_size"):
        raise ModelLoadError(f"{folder}'s target_hidden_size {target} differs from its hidden_size; not supported")
    options = {
        "draft_vocab_size": values.get("draft_vocab_size", layer.get("draft_vocab_size")),
        "norm_before_residual": bool(values.get("norm_before_residual", layer.get("norm_before_residual", False))),
        "aux_layer_ids": tuple(ids) if ids else None,
    }
    for key in ("draft_vocab_size", "norm_before_residual", "eagle_config", "target_hidden_size", "bias"):
        layer.pop(key, None)
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"])
    return layer, options


def load_eagle3(head_dir: str | Path, target_model=None) -> Eagle3Head:
    """Read an EAGLE-3 head in either layout (module doc); the embedding table comes from the checkpoint when it
    has one, else from ``target_model``. Weights are held in float32."""
    from transformers import LlamaConfig

    folder = Path(head_dir)
    layer, options = _read_config(folder, read_json(folder / EAGLE3_CONFIG))
    weights = {}
    for name, tensor in read_weights(folder, EAGLE3_WEIGHTS).items():
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.", 1)
        weights[name] = tensor
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    embed = weights.pop("embed_tokens.weight", None)
    own_embed = embed is not None
    if embed is None:
        if target_model is None:
            raise ModelLoadError(f"{folder} has no embed_tokens of its own; load it with the target model")
        embed = target_model.get_input_embeddings().weight
    lm_head = weights.pop("lm_head.weight", None)
    if lm_head is None:
        if target_model is None:
            raise ModelLoadError(f"{folder} has no lm_head; an EAGLE-3 head needs its own (draft vocabulary)")
        lm_head = target_model.get_output_embeddings().weight
    if "fc.weight" not in weights:
        raise ModelLoadError(f"{folder} has no fc.weight; an EAGLE-3 head maps the target's taps with it")
    ids = ids_from_d2t(d2t) if d2t is not None else None
    if ids is not None and torch.equal(ids, torch.arange(embed.shape[0])):
        ids = None  # the identity mapping: the full vocabulary
    draft_vocab = options["draft_vocab_size"] or lm_head.shape[0]
    if lm_head.shape[0] != draft_vocab:
        raise ModelLoadError(f"{folder}'s lm_head has {lm_head.shape[0]} rows, its config {draft_vocab}")
    hidden = layer["hidden_size"]
    head = Eagle3Head(
        LlamaConfig.from_dict(layer),
        embed,
        lm_head,
        draft_ids=ids,
        num_taps=weights["fc.weight"].shape[1] // hidden,
        aux_layer_ids=options["aux_layer_ids"],
        norm_before_residual=options["norm_before_residual"],
    )
    load_exact(head, weights, folder, skip=("embed_tokens.weight", "lm_head.weight"), problem="is not an EAGLE-3 head")
    head.own_embed = own_embed
    return head.eval()


# The kind --------------------------------------------------------------------------------------------


class Eagle3Kind(EagleKind):
    """EAGLE-3: EAGLE's graph, specializations, custom IO and proposer; the target graph taps three layers."""

    layout = "eagle3"
    expects = f"an EAGLE-3 config.json (architectures {ARCHITECTURES[0]}, or speculators_model_type eagle3)"

    def detect(self, folder: Path, config: dict | None) -> bool:
        return is_eagle3_config(config)

    def load(self, folder: Path, target) -> Eagle3Head:
        return load_eagle3(folder, target)

    def tap_request(self, folder: Path, config: dict | None) -> tuple[int, ...] | str:
        from qspec.export.graph import VLLM_TAPS

        ids = _read_config(folder, config or {})[1]["aux_layer_ids"]
        return tuple(sorted(set(ids))) if ids else VLLM_TAPS

    def taps(self, head: Eagle3Head, num_layers: int) -> TargetTaps:
        ids = head.layer_ids(num_layers)
        width = head.fc.weight.shape[1]
        if width != len(ids) * head.config.hidden_size:
            raise ConfigError(
                f"the EAGLE-3 head's fc reads {width} values, its {len(ids)} taps give "
                f"{len(ids) * head.config.hidden_size}; give eagle_config.eagle_aux_hidden_state_layer_ids"
            )
        return TargetTaps(ids, head.fc.weight.detach().float())

    def trace(self, head, config: SpecializationConfig) -> TracedHead:
        from qspec.heads import export

        cb = config.continuous_batching
        return TracedHead(
            export.trace_eagle(head, continuous_batching=cb, eagle3=True),
            export.eagle_input_names(continuous_batching=cb),
            export.eagle_output_names(),
        )


EAGLE3 = Eagle3Kind()
