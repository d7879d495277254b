"""MTP layers that ship inside the target's checkpoint, read as a draft head (``qspec compile MODEL --mtp``).

An MTP layer is an EAGLE-style head: one decoder block of the target's family with its own KV cache, at the
target's positions. The pair (hidden ``h_t``, token ``x_{t+1}``) sits at position ``t`` (the embedding of the
token at position 0 is zeroed, as vLLM's loaders do); its output drafts ``x_{t+2}``. Depth 0 reads the target's
final-norm hidden state (what vLLM hands its MTP proposers, and what the contract's ``hidden_states`` output
is); depth ``j >= 1`` reads the feature the previous call returned. Draft step ``j`` runs layer ``j % n``
(vLLM's ``spec_step_idx % num_mtp_layers``): each step its own layer where the checkpoint has several
(Step-3.5), one layer chained where it has one (DeepSeek-V3, ATOM).

Layouts, with the tensor names vLLM's loaders read (``L`` = ``num_hidden_layers``, ``n`` =
``num_nextn_predict_layers``, ``i < n``):

================ ============================================== ==============================================
                 ``deepseek`` (nextn; DeepSeek-V3, GLM)          ``mimo`` (``model_type: mimo``, a Qwen2)
================ ============================================== ==============================================
prefix           ``model.layers.{L+i}.``                         ``model.mtp_layers.{i}.``
norms            ``enorm`` (embeds), ``hnorm`` (hidden)          ``token_layernorm``, ``hidden_layernorm``
projection       ``eh_proj`` over cat(enorm(e), hnorm(h))        ``input_proj`` over cat(hidden_ln(h), token_ln(e))
block            the rest of the prefix: a decoder layer         the rest of the prefix: a decoder layer
output           ``shared_head.norm``, ``shared_head.head``      ``final_layernorm``, the target's ``lm_head``
chained feature  the block's output (before ``shared_head.norm``)  ``final_layernorm``'s output
embedding        ``embed_tokens`` of the first MTP layer, else    the target's
                 the target's
================ ============================================== ==============================================

The block keeps its ``input_layernorm`` (unlike EAGLE-1's layer).
"""

from __future__ import annotations

import copy
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from torch import nn

from qspec.errors import ConfigError, ModelLoadError
from qspec.heads.checkpoint import frozen_linear
from qspec.heads.eagle import EagleKind
from qspec.heads.kind import TracedHead
from qspec.specializations import Specialization, SpecializationConfig

MTPLayout = Literal["deepseek", "mimo"]
NEXTN_KEY = "num_nextn_predict_layers"  # how many MTP layers the config says the checkpoint ships
# Checkpoint names of each layout's own tensors -> the module's (the rest of a layer's prefix is its block).
OWN_NAMES: dict[str, dict[str, str]] = {
    "deepseek": {
        "enorm.": "enorm.",
        "hnorm.": "hnorm.",
        "eh_proj.": "eh_proj.",
        "shared_head.norm.": "norm.",
        "shared_head.head.": "head.",
        "embed_tokens.": "embed.",
    },
    "mimo": {
        "token_layernorm.": "enorm.",
        "hidden_layernorm.": "hnorm.",
        "input_proj.": "eh_proj.",
        "final_layernorm.": "norm.",
    },
}
TARGET_EMBED, TARGET_LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


# Detection ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MTPSource:
    """Where a checkpoint keeps its MTP layers: ``layout``, how many (``num_layers``) and the tensor prefix of
    each."""

    layout: MTPLayout
    num_layers: int
    prefixes: tuple[str, ...]


def find_mtp(folder: str | Path) -> MTPSource:
    """The MTP layers of the model folder ``folder``, or a one-line error saying it has none.

    Example: a Llama folder with ``num_hidden_layers: 2`` and tensors ``model.layers.2.eh_proj.weight`` ->
    ``MTPSource("deepseek", 1, ("model.layers.2.",))``.
    """
    from qspec.export.checkpoint import Checkpoint

    path = Path(folder)
    config_file = path / "config.json"
    checkpoint = Checkpoint.find(path) if path.is_dir() else None
    if not config_file.is_file() or checkpoint is None:
        raise ConfigError(f"--mtp reads the MTP layers of a model folder with safetensors weights; {folder} is not one")
    config = json.loads(config_file.read_text())
    names = checkpoint.names
    base = int(config.get("num_hidden_layers", 0))
    count = int(config.get(NEXTN_KEY) or 0)
    for layout, marker in (("mimo", "input_proj.weight"), ("deepseek", "eh_proj.weight")):
        present = 0
        while _prefix(layout, base, present) + marker in names:  # without the config's count, as many as there are
            present += 1
        if present and count and present < count:
            raise ModelLoadError(f"{folder} says {NEXTN_KEY}={count} but holds {present} MTP layers; fix its config")
        if present:
            return MTPSource(layout, count or present, tuple(_prefix(layout, base, i) for i in range(count or present)))
    raise ConfigError(
        f"{folder} has no MTP layers (no model.layers.{base}.eh_proj nor model.mtp_layers.0.input_proj); "
        "drop --mtp or give a checkpoint that ships them"
    )


def _prefix(layout: MTPLayout, num_hidden_layers: int, layer: int) -> str:
    """Tensor prefix of MTP layer ``layer``: ``model.mtp_layers.{i}.`` (MiMo), ``model.layers.{L+i}.`` (DeepSeek)."""
    return f"model.mtp_layers.{layer}." if layout == "mimo" else f"model.layers.{num_hidden_layers + layer}."


# Modules -----------------------------------------------------------------------------------------------


def family_classes(config) -> tuple[type, type, type]:
    """``(DecoderLayer, RMSNorm, RotaryEmbedding)`` of ``config``'s family in transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    family = config.model_type
    prefix = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family].removesuffix("ForCausalLM")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return tuple(getattr(module, prefix + part) for part in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"))


class MTPLayer(nn.Module):
    """One MTP layer: ``fuse`` (norms and projection), ``block`` (a decoder layer), ``finish`` (the chained
    feature), ``logits``."""

    def __init__(self, config, lm_head: torch.Tensor, *, layout: MTPLayout):
        super().__init__()
        layer_class, norm_class, _ = family_classes(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layout = layout
        self.enorm, self.hnorm, self.norm = (norm_class(hidden, eps=eps) for _ in range(3))
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = layer_class(config, layer_idx=0)
        self.head = frozen_linear(lm_head.detach().float().clone())

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The block's input ``[B, T, H]`` from the token embeddings and the hidden states at the same rows."""
        embeds = torch.where((position_ids == 0)[..., None], torch.zeros_like(embeds), embeds)
        e, h = self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))
        return self.eh_proj(torch.cat((h, e) if self.layout == "mimo" else (e, h), dim=-1))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The feature the next depth reads, from the block's output (row by row)."""
        return self.norm(x) if self.layout == "mimo" else x

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary from a :meth:`finish` feature."""
        return self.head(feature if self.layout == "mimo" else self.norm(feature))


class MTPHead(nn.Module):
    """The MTP layers of a checkpoint: ``forward(input_ids, hidden, position_ids, layer) -> (features, logits)``.

    ``config``: the target's config (its family's decoder layer); ``embed_tokens`` [vocab, H] frozen.
    """

    def __init__(self, config, embed_tokens: torch.Tensor, lm_heads: list[torch.Tensor], *, layout: MTPLayout):
        super().__init__()
        config = copy.deepcopy(config)
        config._attn_implementation = "eager"
        config.num_hidden_layers = 1
        self.config, self.layout = config, layout
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.detach().float().clone(), freeze=True)
        self.mtp_layers = nn.ModuleList(MTPLayer(config, head, layout=layout) for head in lm_heads)
        self.rotary_emb = family_classes(config)[2](config)
        self.draft_ids = None  # the full vocabulary: MTP layers predict over the target's

    @property
    def draft_vocab_size(self) -> int:
        return self.mtp_layers[0].head.weight.shape[0]

    def forward(self, input_ids, hidden, position_ids, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced ``(features, logits)`` of layer ``layer`` over ``T`` steps (causal, RoPE at the positions)."""
        mtp = self.mtp_layers[layer]
        x = mtp.fuse(self.embed_tokens(input_ids), hidden, position_ids)
        steps = input_ids.shape[1]
        causal = torch.ones(steps, steps, dtype=torch.bool).tril()
        mask = torch.zeros(steps, steps, dtype=x.dtype).masked_fill(~causal, torch.finfo(x.dtype).min)
        out = mtp.block(
            x,
            attention_mask=mask[None, None],
            position_ids=position_ids,
            position_embeddings=self.rotary_emb(x, position_ids),
        )
        feature = mtp.finish(out[0] if isinstance(out, tuple) else out)
        return feature, mtp.logits(feature)


# Loading -----------------------------------------------------------------------------------------------


def load_mtp(folder: str | Path, target=None) -> tuple[MTPHead, MTPSource]:
    """The MTP layers of model folder ``folder`` (fp32) and where they were found.

    ``target``: the target's tables behind ``get_input_embeddings().weight`` / ``get_output_embeddings().weight``
    (:func:`qspec.heads.package.target_tables`); None reads them from the checkpoint.
    """
    from qspec.export.checkpoint import Checkpoint
    from qspec.export.loader import read_config

    source = find_mtp(folder)
    checkpoint = Checkpoint.find(Path(folder))
    config = read_config(str(folder))
    embed, lm_head = _target_tables(checkpoint, target)
    states = [_layer_state(checkpoint, prefix, source.layout) for prefix in source.prefixes]
    own_embed = states[0].pop("embed.weight", None)  # DeepSeek-V3 repeats it in every layer; the first serves
    heads = [state.pop("head.weight", lm_head) for state in states]
    for state in states[1:]:
        state.pop("embed.weight", None)
    head = MTPHead(config, own_embed if own_embed is not None else embed, heads, layout=source.layout)
    for i, (layer, state) in enumerate(zip(head.mtp_layers, states)):
        result = layer.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        missing = sorted(set(result.missing_keys) - {"head.weight"})
        if missing or result.unexpected_keys:
            raise ModelLoadError(
                f"MTP layer {source.prefixes[i]} of {folder} does not match the {config.model_type} decoder layer: "
                f"missing {missing or 'nothing'}, unexpected {sorted(result.unexpected_keys) or 'nothing'}"
            )
    return head.eval(), source


def _target_tables(checkpoint, target) -> tuple[torch.Tensor, torch.Tensor]:
    if target is not None:
        return target.get_input_embeddings().weight, target.get_output_embeddings().weight
    embed = checkpoint.read(TARGET_EMBED)
    return embed, checkpoint.read(TARGET_LM_HEAD) if TARGET_LM_HEAD in checkpoint else embed


def _layer_state(checkpoint, prefix: str, layout: MTPLayout) -> dict[str, torch.Tensor]:
    """The tensors under ``prefix``, named as :class:`MTPLayer`'s (the block's under ``block.``)."""
    state = {}
    for name in sorted(n for n in checkpoint.names if n.startswith(prefix)):
        rest = name.removeprefix(prefix)
        theirs = next((t for t in OWN_NAMES[layout] if rest.startswith(t)), None)
        key = OWN_NAMES[layout][theirs] + rest.removeprefix(theirs) if theirs else f"block.{rest}"
        state[key] = checkpoint.read(name)
    return state


# The kind ------------------------------------------------------------------------------------------------


class MTPKind(EagleKind):
    """MTP layers of a target's checkpoint, ``layout_name`` naming: one EAGLE-style program per layer
    (:mod:`qspec.heads.mtp_export`), EAGLE's specializations, custom IO and runtime rewrite; run by ``mtp``."""

    method = "mtp"
    layout_name: ClassVar[str]

    def detect(self, folder: Path, config: dict | None) -> bool:
        if config is None:
            return False
        try:
            return find_mtp(folder).layout == self.layout_name
        except (ConfigError, ModelLoadError):
            return False

    def load(self, folder: Path, target) -> MTPHead:
        return load_mtp(folder, target)[0]

    def programs(self, head) -> int:
        return len(head.mtp_layers)

    def trace(self, head, config: SpecializationConfig) -> TracedHead:
        return self.trace_program(head, config, 0)

    def trace_program(self, head, config: SpecializationConfig, program: int) -> TracedHead:
        """MTP layer ``program``'s graph."""
        from qspec.heads import export
        from qspec.heads.mtp_export import trace_mtp

        cb = config.continuous_batching
        return TracedHead(
            trace_mtp(head, program, continuous_batching=cb),
            export.eagle_input_names(continuous_batching=cb),
            export.eagle_output_names(),
        )

    def fuse(self, model, head, config: SpecializationConfig, specs: list[Specialization]) -> dict:
        """EAGLE's fusions on the block (every layer's block has the same attention shapes and RoPE)."""
        from qspec.heads import ort_graph
        from qspec.heads.mtp_export import mtp_attention_info
        from qspec.package import attention_slack

        kv_slack = attention_slack(max(spec.seq_len for spec in specs))
        rope_positions = config.ctx_len + kv_slack
        fusions = ort_graph.fuse_eagle(model, mtp_attention_info(head, 0), rope_positions=rope_positions)
        return {"fusions": fusions, "kv_slack": kv_slack, "rope_positions": rope_positions}

    def manifest_fields(self, head, config: SpecializationConfig) -> dict:
        from qspec.heads.mtp_export import head_dim

        return {
            "num_heads": 1,
            "num_layers": len(head.mtp_layers),
            "num_kv_heads": head.config.num_key_value_heads,
            "head_dim": head_dim(head),
            "ctx_len": config.ctx_len,
        }


class DeepSeekMTPKind(MTPKind):
    layout, layout_name = "deepseek-mtp", "deepseek"
    expects = "MTP layers model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head} (num_nextn_predict_layers)"


class MiMoMTPKind(MTPKind):
    layout, layout_name = "mimo-mtp", "mimo"
    expects = "MiMo's MTP layers model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj}"


DEEPSEEK_MTP, MIMO_MTP = DeepSeekMTPKind(), MiMoMTPKind()
