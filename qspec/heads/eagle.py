"""EAGLE-1 (SafeAILab/EAGLE ``cnets1.py``, vLLM ``llama_eagle.py``): the torch module, its checkpoint layout,
and its :class:`~qspec.heads.kind.HeadKind`.

The head reads the target's **features**: its final-norm hidden state, what its LM head reads (Hugging
Face ``hidden_states[-1]``). One Llama decoder layer without ``input_layernorm`` and without a final norm,
over ``fc(cat(embed(x_{t+1}), h_t))`` (embeddings first). The pair (feature ``h_t``, token ``x_{t+1}``) sits
at head position ``t`` and predicts ``h_{t+1}``, whose LM-head argmax drafts ``x_{t+2}``. Worked example:
prompt ``x_0..x_3`` with features ``h_0..h_3`` and the target's next token ``x_4``: the head reads
``(h_0, x_1) .. (h_3, x_4)`` at positions 0..3; its last row drafts ``x_5``; the next chained call reads
(that row's feature, ``x_5``) at position 4.

A reduced draft vocabulary is a list of target ids (``draft_ids``); files store it as EAGLE-3 does,
``d2t[i] = draft_ids[i] - i`` (so ``target = draft + d2t[draft]``) and a ``t2d`` membership mask.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from qspec import contract
from qspec.common import with_umask
from qspec.errors import ConfigError, ModelLoadError
from qspec.heads import parallel
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
from qspec.heads.kind import HeadKind, TracedHead
from qspec.specializations import Specialization, SpecializationConfig

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
        self.parallel = None  # ParallelDrafting: a head that also drafts K tokens in one call (heads/parallel.py)

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
    values = clean_config((config or head.config).to_dict())  # no machine path, no transformers boilerplate
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
    if head.parallel is not None:
        values[parallel.CONFIG_KEY] = head.parallel.model_dump()
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
    settings = values.get(parallel.CONFIG_KEY)
    values = {k: v for k, v in values.items() if k not in ("bias", "draft_vocab_size", parallel.CONFIG_KEY)}
    head = EagleHead(
        LlamaConfig.from_dict(values),
        *tables,
        draft_ids=ids_from_d2t(d2t) if d2t is not None else None,
        fc_bias="fc.bias" in weights,
    )
    if settings is not None:
        parallel.enable_parallel(head, parallel.ParallelDrafting(**settings))
    load_exact(head, weights, folder, skip=TABLES, problem="is not an EAGLE-1 head")
    head.own_tables = frozenset(own)
    return head.eval()


# The kind ------------------------------------------------------------------------------------------------


def eagle_specializations(config: SpecializationConfig, depth: int = 1) -> list[Specialization]:
    """The target's prefill shape, then ``seq_len`` 1 and ``K + 1`` per compiled K, ascending (no logits
    count: the head returns each row's last real token, or a parallel head's last ``depth``). A parallel head
    also drafts a step in one call: its ``K + 1`` pairs and ``min(depth, K) - 1`` mask pairs, ``K + min(depth,
    K)`` per compiled K >= 1. Example, ``K = 0, 1, 4``, prefill 32, ctx 128, batch 1: seq_len 32, 1, 2, 5;
    with depth 3: 32, 1, 2, 5, 7."""
    rows, fbs = config.full_batch_size or config.batch_size, config.full_batch_size
    prefill = Specialization(
        batch_size=config.batch_size, seq_len=config.prefill_seq_len, ctx_len=config.ctx_len, full_batch_size=fbs
    )
    ks = config.num_speculative_tokens
    steps = sorted({1, *(k + 1 for k in ks), *(k + min(depth, k) for k in ks if k)})  # depth 1: k + 1 again
    decode = [Specialization(batch_size=rows, seq_len=s, ctx_len=config.ctx_len, full_batch_size=fbs) for s in steps]
    return dedupe([prefill, *decode])


def dedupe(specs: list[Specialization]) -> list[Specialization]:
    kept: list[Specialization] = []
    for spec in specs:
        if spec not in kept:
            kept.append(spec)
    return kept


class EagleKind(HeadKind):
    """EAGLE-1: one chained decoder layer with its own KV cache (:mod:`qspec.heads.export`'s EAGLE graph)."""

    layout = "eagle"
    method = "eagle"
    expects = "an EAGLE-1 config.json (one layer) with model.safetensors or pytorch_model.bin"

    def detect(self, folder: Path, config: dict | None) -> bool:
        return config is not None and config.get("num_hidden_layers") == 1

    def load(self, folder: Path, target) -> EagleHead:
        return load_eagle(folder, target)

    def hidden_size(self, head) -> int:
        return head.config.hidden_size

    def trace(self, head, config: SpecializationConfig) -> TracedHead:
        from qspec.heads import export

        cb = config.continuous_batching
        return TracedHead(
            export.trace_eagle(head, continuous_batching=cb),
            export.eagle_input_names(continuous_batching=cb),
            export.eagle_output_names(),
        )

    def specializations(self, head, config: SpecializationConfig) -> list[Specialization]:
        from qspec.heads.export import head_keep

        return eagle_specializations(config, head_keep(head))

    def write_specializations(self, specs: list[Specialization], path: Path, fmt: str) -> None:
        from qspec.spec_file import write_specializations

        write_specializations(specs, path, fmt=fmt)

    def custom_io(self, kv_dtype: str) -> str:
        """Its KV and the features it reads and writes, in ``kv_dtype`` (the target's ``hidden_states`` output
        has the same precision, so the runtime hands it over unconverted)."""
        from qspec.backends.qaic import custom_io_yaml

        names = [contract.HIDDEN_STATES, contract.HIDDEN_STATES_OUT]
        features = "".join(f" - IOName: {name}\n   Precision: {kv_dtype}\n\n" for name in names)
        return custom_io_yaml(1, kv_dtype=kv_dtype) + features

    def fuse(self, model, head, config: SpecializationConfig, specs: list[Specialization]) -> dict:
        """``GroupQueryAttention`` and RMSNorm fusions (:mod:`qspec.heads.ort_graph`)."""
        from qspec.heads import export, ort_graph
        from qspec.package import attention_slack

        kv_slack = attention_slack(max(spec.seq_len for spec in specs))
        rope_positions = config.ctx_len + kv_slack
        fusions = ort_graph.fuse_eagle(model, export.eagle_attention_info(head), rope_positions=rope_positions)
        return {"fusions": fusions, "kv_slack": kv_slack, "rope_positions": rope_positions}

    def manifest_fields(self, head, config: SpecializationConfig) -> dict:
        return {
            "num_heads": 1,
            "num_layers": 1,
            "num_kv_heads": head.config.num_key_value_heads,
            "head_dim": head.layers[0].self_attn.head_dim,
            "ctx_len": config.ctx_len,
        }


EAGLE = EagleKind()
