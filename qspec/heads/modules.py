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

EAGLE_CONFIG = "config.json"
EAGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
MEDUSA_CONFIG = "config.json"
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
VLLM_MEDUSA_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
TURBO_CONFIG = "speculator_config.json"
TURBO_WEIGHTS = "speculator.safetensors"
TABLES = ("embed_tokens.weight", "lm_head.weight")  # EAGLE tensors that default to the target's


# Draft vocabulary ------------------------------------------------------------------------------------


def d2t_from_ids(draft_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's offsets: ``d2t[i] = draft_ids[i] - i``. Example: ids ``[0, 5, 9]`` -> ``[0, 4, 7]``."""
    return draft_ids.long() - torch.arange(draft_ids.numel(), dtype=torch.long)


def ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of the draft vocabulary: ``i + d2t[i]``."""
    return torch.arange(d2t.numel(), dtype=torch.long) + d2t.long()


def t2d_from_ids(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """EAGLE-3's ``t2d``: a bool mask over the target vocabulary, True where a draft id exists."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[draft_ids.long()] = True
    return mask


def _check_draft_ids(draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    if draft_ids is None:
        return None
    ids = torch.as_tensor(draft_ids, dtype=torch.long).flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ConfigError(f"draft ids must be target token ids in [0, {vocab_size}); got {ids.numel()} ids")
    if ids.unique().numel() != ids.numel():
        raise ConfigError("draft ids repeat a target id; give each target id at most once")
    return ids


def _draft_rows(table: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The LM-head rows of the draft vocabulary: ``table`` itself if it already has one row per draft id."""
    table = table.detach().float()
    if draft_ids is None or table.shape[0] == draft_ids.numel():
        return table.clone()
    return table[draft_ids].clone()


def _frozen_linear(rows: torch.Tensor) -> nn.Linear:
    """``nn.Linear`` computing ``x @ rows.T``, not trained."""
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
    linear.weight = nn.Parameter(rows, requires_grad=False)
    return linear


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
        ids = _check_draft_ids(draft_ids, embed_tokens.shape[0])
        if ids is None and lm_head.shape[0] != embed_tokens.shape[0]:
            raise ConfigError(
                f"the LM head has {lm_head.shape[0]} rows and the vocabulary {embed_tokens.shape[0]}; "
                "a reduced draft vocabulary needs its d2t table"
            )
        self.lm_head = _frozen_linear(_draft_rows(lm_head, ids))
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
    values = _read_json(folder / EAGLE_CONFIG)
    weights = {name.removeprefix("model."): tensor for name, tensor in _read_weights(folder, EAGLE_WEIGHTS).items()}
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
    result = head.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    missing = sorted(set(result.missing_keys) - set(TABLES))
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"{folder} is not an EAGLE-1 head: missing {missing or 'nothing'}, "
            f"unexpected {sorted(result.unexpected_keys) or 'nothing'}"
        )
    head.own_tables = frozenset(own)
    return head.eval()


# Medusa-1 and turbo ----------------------------------------------------------------------------------


class ResBlock(nn.Module):
    """Medusa's residual block: ``x + SiLU(linear(x))``, zero-initialized (an identity at first)."""

    def __init__(self, hidden_size: int, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=bias)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def residual_stack(hidden_size: int, num_layers: int, *, shared: bool, bias: bool = True) -> nn.Sequential:
    """A head's blocks. ``shared``: FasterDecoding's and QEfficient's ``[ResBlock(h)] * num_layers``, ONE
    module repeated (its layers share weights; a loaded file's last layer wins, as in ``load_state_dict``)."""
    if shared:
        return nn.Sequential(*([ResBlock(hidden_size, bias)] * num_layers))
    return nn.Sequential(*(ResBlock(hidden_size, bias) for _ in range(num_layers)))


class MedusaHead(nn.Module):
    """Medusa-1 heads: ``forward(hidden [B, T, H]) -> logits [B, T, num_heads, draft_vocab]``.

    ``lm_head``: [vocab, H] (the target's, or rows per draft id). ``per_head_lm_head``: each head gets a
    trainable copy (Medusa-1's layout); otherwise one frozen LM head serves every head (turbo, vLLM's
    ``original_lm_head``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_layers: int,
        lm_head: torch.Tensor,
        *,
        draft_ids: torch.Tensor | None = None,
        per_head_lm_head: bool = False,
        shared_layers: bool = True,
        bias: bool = True,
        vocab_size: int | None = None,
    ):
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ConfigError(f"a Medusa head needs num_heads >= 1 and num_layers >= 1; got {num_heads}, {num_layers}")
        self.hidden_size, self.num_heads, self.num_layers = hidden_size, num_heads, num_layers
        self.shared_layers = shared_layers
        self.vocab_size = vocab_size or lm_head.shape[0]
        ids = _check_draft_ids(draft_ids, self.vocab_size)
        rows = _draft_rows(lm_head, ids)
        self.blocks = nn.ModuleList(
            residual_stack(hidden_size, num_layers, shared=shared_layers, bias=bias) for _ in range(num_heads)
        )
        if per_head_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, rows.shape[0], bias=False) for _ in range(num_heads))
            for linear in self.lm_heads:
                linear.weight.data.copy_(rows)
        else:
            self.lm_head = _frozen_linear(rows)
        self.register_buffer("draft_ids", ids, persistent=False)

    @property
    def per_head_lm_head(self) -> bool:
        return hasattr(self, "lm_heads")

    @property
    def draft_vocab_size(self) -> int:
        return (self.lm_heads[0] if self.per_head_lm_head else self.lm_head).weight.shape[0]

    def head_lm(self, k: int) -> nn.Linear:
        return self.lm_heads[k] if self.per_head_lm_head else self.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = [self.head_lm(k)(block(hidden)) for k, block in enumerate(self.blocks)]
        return torch.stack(logits, dim=2)  # [B, T, num_heads, draft_vocab]

    def to_target(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        return draft_tokens if self.draft_ids is None else self.draft_ids[draft_tokens]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The blocks, and the per-head LM heads when there are any."""
        return [p for p in self.parameters() if p.requires_grad]

    def share_equal_lm_heads(self) -> bool:
        """One frozen LM head for all heads when their per-head tables are equal (Medusa-1 files store one
        per head even when they were never trained apart); returns whether it did."""
        if not self.per_head_lm_head or any(
            not torch.equal(linear.weight, self.lm_heads[0].weight) for linear in self.lm_heads
        ):
            return False
        rows = self.lm_heads[0].weight.detach().clone()
        del self.lm_heads
        self.lm_head = _frozen_linear(rows)
        return True


def medusa_from_target(
    target_model,
    num_heads: int,
    num_layers: int = 1,
    *,
    draft_ids: torch.Tensor | None = None,
    per_head_lm_head: bool = False,
) -> MedusaHead:
    """Fresh Medusa-1 heads on ``target_model``'s LM head (FasterDecoding's shared-layer blocks)."""
    lm = target_model.get_output_embeddings().weight
    return MedusaHead(lm.shape[1], num_heads, num_layers, lm, draft_ids=draft_ids, per_head_lm_head=per_head_lm_head)


def save_medusa(
    head: MedusaHead, out_dir: str | Path, *, dtype: torch.dtype = torch.float16, base_model_name_or_path: str = ""
) -> Path:
    """FasterDecoding's layout: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``) and
    ``medusa_lm_head.safetensors`` with keys ``{k}.{l}.linear.*`` and ``{k}.{num_layers}.weight`` (every
    head's LM head, as Medusa-1 keeps one per head); a reduced vocabulary adds vLLM's ``token_map``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, block in enumerate(head.blocks):
        for name, tensor in block.state_dict().items():  # every layer's key, shared or not (as torch writes it)
            tensors[f"{k}.{name}"] = tensor.detach().to(dtype).clone()
        tensors[f"{k}.{head.num_layers}.weight"] = head.head_lm(k).weight.detach().to(dtype).clone()
    if head.draft_ids is not None:
        tensors["token_map"] = head.draft_ids.clone()
    save_file(tensors, str(out / MEDUSA_WEIGHTS[0]), metadata={"format": "pt"})
    with_umask(out / MEDUSA_WEIGHTS[0], 0o666)  # safetensors writes 0600
    config = {
        "medusa_num_heads": head.num_heads,
        "medusa_num_layers": head.num_layers,
        "hidden_size": head.hidden_size,
        "vocab_size": head.vocab_size,
        "base_model_name_or_path": base_model_name_or_path,
    }
    if head.draft_ids is not None:
        config["truncated_vocab_size"] = head.draft_vocab_size
    if not head.shared_layers:
        config["medusa_shared_layers"] = False  # not FasterDecoding's blocks: readers of that layout would share
    (out / MEDUSA_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_medusa(head_dir: str | Path, target_model=None) -> MedusaHead:
    """Read Medusa heads: FasterDecoding's ``medusa_lm_head.{safetensors,pt}`` (shared-layer blocks) or
    vLLM's ``blocks.{k}.layers.{l}`` / ``lm_heads.{k}`` / ``lm_head`` names (distinct layers)."""
    folder = Path(head_dir)
    config = _read_json(folder / MEDUSA_CONFIG)
    num_heads = config.get("medusa_num_heads", config.get("num_heads"))
    num_layers = config.get("medusa_num_layers", config.get("num_hidden_layers"))
    if num_heads is None or num_layers is None:
        raise ModelLoadError(f"{folder / MEDUSA_CONFIG} names no medusa_num_heads/medusa_num_layers")
    if any((folder / name).is_file() for name in MEDUSA_WEIGHTS):
        weights = {k.removeprefix("medusa_head."): v for k, v in _read_weights(folder, MEDUSA_WEIGHTS).items()}
        shared = config.get("medusa_shared_layers", True)
    else:
        weights = _vllm_medusa_names(_read_weights(folder, VLLM_MEDUSA_WEIGHTS), num_layers)
        shared = False
    token_map = weights.pop("token_map", None)
    lm = weights.pop("lm_head.weight", None)  # one LM head for every head (vLLM's original_lm_head)
    per_head = f"0.{num_layers}.weight" in weights
    if lm is None and not per_head:
        if target_model is None:
            raise ModelLoadError(f"{folder} has no LM head of its own; load it with the target model")
        lm = target_model.get_output_embeddings().weight
    table = weights[f"0.{num_layers}.weight"] if per_head else lm
    hidden = config.get("hidden_size", table.shape[1])
    head = MedusaHead(
        hidden,
        num_heads,
        num_layers,
        table,
        draft_ids=token_map,
        per_head_lm_head=per_head,
        shared_layers=shared,
        bias="0.0.linear.bias" in weights,
        vocab_size=config.get("vocab_size") if token_map is not None else None,
    )
    state = {f"blocks.{name}": tensor for name, tensor in weights.items() if not name.endswith(f".{num_layers}.weight")}
    if per_head:
        state |= {f"lm_heads.{k}.weight": weights[f"{k}.{num_layers}.weight"] for k in range(num_heads)}
    _load_exact(head, state, folder, skip=() if per_head else ("lm_head.weight",))
    return head.eval()


def _vllm_medusa_names(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """vLLM's Medusa names in FasterDecoding's: ``blocks.{k}.layers.{l}.w`` -> ``{k}.{l}.linear.w``,
    ``lm_heads.{k}.weight`` -> ``{k}.{num_layers}.weight``."""
    renamed = {}
    for name, tensor in weights.items():
        parts = name.removeprefix("medusa_heads.").split(".")
        if parts[0] == "blocks" and parts[2] == "layers":
            renamed[f"{parts[1]}.{parts[3]}.linear.{parts[4]}"] = tensor
        elif parts[0] == "lm_heads":
            renamed[f"{parts[1]}.{num_layers}.weight"] = tensor
        else:
            renamed[".".join(parts)] = tensor
    return renamed


def save_turbo(head: MedusaHead, out_dir: str | Path, *, dtype: torch.dtype = torch.float16) -> Path:
    """QEfficient's turbo layout: ``speculator_config.json`` and ``speculator.safetensors`` with
    ``projections.{k}.{l}.linear.*`` (every layer's key; the target's LM head is not stored)."""
    from safetensors.torch import save_file

    if head.per_head_lm_head or head.draft_ids is not None:
        raise ConfigError("turbo projections use the target's full LM head; save this head with save_medusa")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"projections.{k}.{name}": tensor.detach().to(dtype).clone()
        for k, block in enumerate(head.blocks)
        for name, tensor in block.state_dict().items()
    }
    save_file(tensors, str(out / TURBO_WEIGHTS), metadata={"format": "pt"})
    with_umask(out / TURBO_WEIGHTS, 0o666)  # safetensors writes 0600
    config = {"model_type": "turbo", "turbo_num_heads": head.num_heads, "turbo_num_layers": head.num_layers}
    (out / TURBO_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_turbo(head_dir: str | Path, target_model) -> MedusaHead:
    """Read QEfficient turbo projections (shared-layer blocks) onto ``target_model``'s LM head."""
    from safetensors.torch import load_file

    folder = Path(head_dir)
    config = _read_json(folder / TURBO_CONFIG)
    if not (folder / TURBO_WEIGHTS).is_file():
        raise ModelLoadError(f"{folder} has no {TURBO_WEIGHTS}; a turbo head needs it beside {TURBO_CONFIG}")
    weights = {k.removeprefix("projections."): v for k, v in load_file(str(folder / TURBO_WEIGHTS)).items()}
    lm = target_model.get_output_embeddings().weight
    head = MedusaHead(
        lm.shape[1],
        config["turbo_num_heads"],
        config["turbo_num_layers"],
        lm,
        shared_layers=True,
        bias="0.0.linear.bias" in weights,
    )
    _load_exact(head, {f"blocks.{name}": tensor for name, tensor in weights.items()}, folder, skip=("lm_head.weight",))
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
        config = _read_json(folder / EAGLE_CONFIG)
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


def _load_exact(head: nn.Module, state: dict[str, torch.Tensor], folder: Path, *, skip: tuple[str, ...]) -> None:
    result = head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = sorted(set(result.missing_keys) - set(skip))
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"{folder} does not match its config: missing {missing or 'nothing'}, "
            f"unexpected {sorted(result.unexpected_keys) or 'nothing'}"
        )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; give the folder of a head checkpoint")
    return json.loads(path.read_text())


def _read_weights(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The first of ``names`` that exists: safetensors, or a torch pickle read with ``weights_only``."""
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{folder} has none of {', '.join(names)}")
