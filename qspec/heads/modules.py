"""Draft heads as torch modules, and the checkpoint layouts other tools read and write.

Both heads read the target's **features**: its final-norm hidden state, what its LM head reads (Hugging
Face ``hidden_states[-1]``).

**EAGLE-1** (SafeAILab/EAGLE ``cnets1.py``, vLLM ``llama_eagle.py``): one Llama decoder layer without
``input_layernorm`` and without a final norm, over ``fc(cat(embed(x_{t+1}), h_t))`` (embeddings first).
The pair (feature ``h_t``, token ``x_{t+1}``) sits at head position ``t`` and predicts ``h_{t+1}``, whose
LM-head argmax drafts ``x_{t+2}``. Worked example: prompt ``x_0..x_3`` with features ``h_0..h_3`` and the
target's next token ``x_4``: the head reads ``(h_0, x_1) .. (h_3, x_4)`` at positions 0..3; its last row
drafts ``x_5``; the next chained call reads (that row's feature, ``x_5``) at position 4.

**Medusa-1** (FasterDecoding/Medusa): head ``k`` (0-based) maps ``h_t`` through residual blocks
``x + SiLU(W x + b)`` and an LM head to a draft of ``x_{t+2+k}``. FasterDecoding builds a head's blocks
as ``nn.Sequential(*([ResBlock(h)] * num_layers))``: one module repeated, so the layers of a head share
their weights. QEfficient's turbo projections do the same and use the target's LM head; both are
reproduced exactly (:func:`residual_stack`). vLLM's layout has distinct layers.

A reduced draft vocabulary is a list of target ids (``draft_ids``); files store it as EAGLE-3 does,
``d2t[i] = draft_ids[i] - i`` (so ``target = draft + d2t[draft]``) and a ``t2d`` membership mask, or
as vLLM's Medusa ``token_map`` (the ids themselves).
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
    d2t_from_ids,
    draft_rows,
    frozen_linear,
    ids_from_d2t,
    load_exact,
    read_json,
    read_weights,
    t2d_from_ids,
)
from qspec.heads.medusa import (  # noqa: F401  (the layouts' public names, from one module)
    MEDUSA_CONFIG,
    MEDUSA_WEIGHTS,
    TURBO_CONFIG,
    TURBO_WEIGHTS,
    VLLM_MEDUSA_WEIGHTS,
    MedusaHead,
    ResBlock,
    load_medusa,
    load_turbo,
    medusa_from_target,
    residual_stack,
    save_medusa,
    save_turbo,
)

EAGLE_CONFIG = "config.json"
EAGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
TABLES = ("embed_tokens.weight", "lm_head.weight")  # EAGLE tensors that default to the target's


# EAGLE-1 ---------------------------------------------------------------------------------------------


class EagleHead(nn.Module):
    """EAGLE-1 draft head: ``forward(input_ids, hidden, position_ids) -> features``, ``logits(features)``.

    ``config``: a ``LlamaConfig`` with ``num_hidden_layers=1`` and the target's attention shapes, MLP size,
    RoPE and RMS eps. ``embed_tokens`` [vocab, H] and ``lm_head`` ([vocab, H], or [draft_vocab, H] when
    it is already the draft vocabulary's rows) are frozen. ``draft_ids`` [draft_vocab]: target ids of the
    draft vocabulary (None: the full vocabulary).
    """

    def __init__(
        self,
        config,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        *,
        draft_ids: torch.Tensor | None = None,
        fc_bias: bool = False,  # vLLM's EAGLE-1 fc has none; the authors' loader reads config "bias"
    ):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        if config.num_hidden_layers != 1:
            raise ConfigError(f"an EAGLE-1 head has one decoder layer; its config says {config.num_hidden_layers}")
        hidden = config.hidden_size
        if embed_tokens.shape[1] != hidden or lm_head.shape[1] != hidden:
            raise ConfigError(
                f"the head's hidden_size {hidden} differs from its tables' width "
                f"{embed_tokens.shape[1]}/{lm_head.shape[1]}; use a head trained for this target"
            )
        config = copy.deepcopy(config)
        config._attn_implementation = "eager"
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.detach().float().clone(), freeze=True)
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # EAGLE-1's layer 0 reads fc's output unnormalized
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(config)
        ids = check_draft_ids(draft_ids, embed_tokens.shape[0])
        if ids is None and lm_head.shape[0] != embed_tokens.shape[0]:
            raise ConfigError(
                f"the LM head has {lm_head.shape[0]} rows and the vocabulary {embed_tokens.shape[0]}; "
                "a reduced draft vocabulary needs its d2t table"
            )
        self.lm_head = frozen_linear(draft_rows(lm_head, ids))
        self.register_buffer("draft_ids", ids, persistent=False)
        self.own_tables: frozenset[str] = frozenset()  # tables the checkpoint holds (saved back with it)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced features ``[B, T, H]``: causal attention over the ``T`` steps, RoPE at ``position_ids``."""
        x = self.fc(torch.cat((self.embed_tokens(input_ids), hidden.to(self.fc.weight.dtype)), dim=-1))
        steps = input_ids.shape[1]
        causal = torch.ones(steps, steps, dtype=torch.bool, device=x.device).tril()
        mask = torch.zeros(steps, steps, dtype=x.dtype, device=x.device).masked_fill(~causal, torch.finfo(x.dtype).min)
        cos_sin = self.rotary_emb(x, position_ids)
        return self.layers[0](
            x, attention_mask=mask[None, None], position_ids=position_ids, position_embeddings=cos_sin
        )

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, T, draft_vocab]`` over the draft vocabulary (map argmaxes with :meth:`to_target`)."""
        return self.lm_head(features)

    def to_target(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Target ids of draft-vocabulary indices."""
        return draft_tokens if self.draft_ids is None else self.draft_ids[draft_tokens]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """``fc`` and the decoder layer; the embedding and LM-head tables stay the target's."""
        return [p for name, p in self.named_parameters() if not name.startswith(("embed_tokens.", "lm_head."))]


def eagle_config(target_config, **overrides):
    """A one-layer ``LlamaConfig`` with the target's attention, MLP, RoPE and norm settings."""
    from transformers import LlamaConfig

    values = target_config.to_dict()
    values.update(num_hidden_layers=1, model_type="llama", architectures=["LlamaForCausalLM"], **overrides)
    for key in ("layer_types", "quantization_config", "auto_map"):
        values.pop(key, None)
    return LlamaConfig.from_dict(values)


def eagle_from_target(target_model, *, draft_ids: torch.Tensor | None = None, fc_bias: bool = False) -> EagleHead:
    """A fresh EAGLE-1 head for ``target_model`` (an HF causal LM): its embeddings and LM head, frozen."""
    return EagleHead(
        eagle_config(target_model.config),
        target_model.get_input_embeddings().weight,
        target_model.get_output_embeddings().weight,
        draft_ids=draft_ids,
        fc_bias=fc_bias,
    )


def save_eagle(head: EagleHead, out_dir: str | Path, *, config=None, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``config.json`` (Llama, one layer) and ``model.safetensors`` under the EAGLE-1 names.

    The target's tables are left out unless the head was loaded with its own; a reduced vocabulary is
    stored as EAGLE-3's ``d2t`` (int64) and ``t2d`` (bool). Returns ``out_dir``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to(dtype).contiguous()
        for name, tensor in head.state_dict().items()
        if name not in TABLES or name in head.own_tables
    }
    vocab = head.embed_tokens.weight.shape[0]
    if head.draft_ids is not None:
        tensors["d2t"] = d2t_from_ids(head.draft_ids)
        tensors["t2d"] = t2d_from_ids(head.draft_ids, vocab)
    save_file(tensors, str(out / EAGLE_WEIGHTS[0]), metadata={"format": "pt"})
    with_umask(out / EAGLE_WEIGHTS[0], 0o666)  # safetensors writes 0600
    values = (config or head.config).to_dict()
    values.pop("_attn_implementation", None)
    values.update(
        num_hidden_layers=1,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        bias=head.fc.bias is not None,  # the EAGLE authors' loader reads it
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    if head.draft_ids is not None:
        values["draft_vocab_size"] = head.draft_vocab_size
    rope = values.get("rope_parameters") or {}
    if "rope_theta" not in values and "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]  # loaders before transformers 5 read it here
    (out / EAGLE_CONFIG).write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    return out


def load_eagle(head_dir: str | Path, target_model=None) -> EagleHead:
    """Read an EAGLE-1 checkpoint (``model.safetensors`` or ``pytorch_model.bin``, optional ``d2t``).

    ``embed_tokens`` / ``lm_head`` come from the checkpoint when it has them, else from ``target_model``
    (an HF causal LM). Weights are held in float32.
    """
    from transformers import LlamaConfig

    folder = Path(head_dir)
    values = read_json(folder / EAGLE_CONFIG)
    weights = {name.removeprefix("model."): tensor for name, tensor in read_weights(folder, EAGLE_WEIGHTS).items()}
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    own = {name: weights.pop(name) for name in TABLES if name in weights}
    target_tables = (
        (target_model.get_input_embeddings().weight, target_model.get_output_embeddings().weight)
        if target_model is not None
        else (None, None)
    )
    tables = [own.get(name, fallback) for name, fallback in zip(TABLES, target_tables)]
    if any(table is None for table in tables):
        raise ModelLoadError(f"{folder} has no embed_tokens/lm_head of its own; load it with the target model")
    values = {k: v for k, v in values.items() if k not in ("bias", "draft_vocab_size")}
    head = EagleHead(
        LlamaConfig.from_dict(values),
        *tables,
        draft_ids=ids_from_d2t(d2t) if d2t is not None else None,
        fc_bias="fc.bias" in weights,
    )
    load_exact(head, weights, folder, skip=TABLES, problem="is not an EAGLE-1 head")
    head.own_tables = frozenset(own)
    return head.eval()


# Any layout -------------------------------------------------------------------------------------------


def detect_layout(head_dir: str | Path) -> str:
    """``eagle``, ``medusa`` or ``turbo``, from the files of ``head_dir``."""
    folder = Path(head_dir)
    if (folder / TURBO_CONFIG).is_file():
        return "turbo"
    if any((folder / name).is_file() for name in MEDUSA_WEIGHTS):
        return "medusa"
    if (folder / EAGLE_CONFIG).is_file():
        config = read_json(folder / EAGLE_CONFIG)
        if "medusa_num_heads" in config or "num_heads" in config:
            return "medusa"
        if config.get("num_hidden_layers") == 1:
            return "eagle"
    raise ModelLoadError(
        f"{folder} holds no draft head: expected an EAGLE-1 config.json (one layer) with model.safetensors or "
        f"pytorch_model.bin, Medusa's {MEDUSA_WEIGHTS[0]}, or turbo's {TURBO_CONFIG} + {TURBO_WEIGHTS}"
    )


def load_head(head_dir: str | Path, target_model=None) -> tuple[nn.Module, str]:
    """Any supported head and its layout name (see :func:`detect_layout`)."""
    layout = detect_layout(head_dir)
    loader = {"eagle": load_eagle, "medusa": load_medusa, "turbo": load_turbo}[layout]
    return loader(head_dir, target_model), layout
