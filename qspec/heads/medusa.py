"""Medusa-1 (FasterDecoding, vLLM) and QEfficient turbo heads: residual blocks over the target's feature, one
draft per head (see :mod:`qspec.heads.modules` for the layouts and the shared-layer quirk), and their two
:class:`~qspec.heads.kind.HeadKind` entries (one graph, one runtime proposer: ``medusa``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from qspec import contract
from qspec.common import with_umask, write_text_atomic
from qspec.errors import ConfigError, ModelLoadError
from qspec.heads.checkpoint import (
    check_draft_ids,
    draft_rows,
    frozen_linear,
    load_exact,
    read_json,
    read_weights,
)
from qspec.heads.kind import HeadKind, TracedHead
from qspec.specializations import Specialization, SpecializationConfig

MEDUSA_CONFIG = "config.json"
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
VLLM_MEDUSA_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
TURBO_CONFIG = "speculator_config.json"
TURBO_WEIGHTS = "speculator.safetensors"


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
        ids = check_draft_ids(draft_ids, self.vocab_size)
        rows = draft_rows(lm_head, ids)
        self.blocks = nn.ModuleList(
            residual_stack(hidden_size, num_layers, shared=shared_layers, bias=bias) for _ in range(num_heads)
        )
        if per_head_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, rows.shape[0], bias=False) for _ in range(num_heads))
            for linear in self.lm_heads:
                linear.weight.data.copy_(rows)
        else:
            self.lm_head = frozen_linear(rows)
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
        self.lm_head = frozen_linear(rows)
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
    config = read_json(folder / MEDUSA_CONFIG)
    num_heads = config.get("medusa_num_heads", config.get("num_heads"))
    num_layers = config.get("medusa_num_layers", config.get("num_hidden_layers"))
    if num_heads is None or num_layers is None:
        raise ModelLoadError(f"{folder / MEDUSA_CONFIG} names no medusa_num_heads/medusa_num_layers")
    if any((folder / name).is_file() for name in MEDUSA_WEIGHTS):
        weights = {k.removeprefix("medusa_head."): v for k, v in read_weights(folder, MEDUSA_WEIGHTS).items()}
        shared = config.get("medusa_shared_layers", True)
    else:
        weights = _vllm_medusa_names(read_weights(folder, VLLM_MEDUSA_WEIGHTS), num_layers)
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
    load_exact(head, state, folder, skip=() if per_head else ("lm_head.weight",))
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
    config = read_json(folder / TURBO_CONFIG)
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
    load_exact(head, {f"blocks.{name}": tensor for name, tensor in weights.items()}, folder, skip=("lm_head.weight",))
    return head.eval()


# The kinds -----------------------------------------------------------------------------------------------


def medusa_specializations(config: SpecializationConfig) -> list[Specialization]:
    """One shape per row count: the prefill's and the decode's (``seq_len`` 1, no KV)."""
    rows = config.full_batch_size or config.batch_size
    specs = [Specialization(batch_size=b, seq_len=1, ctx_len=config.ctx_len) for b in (config.batch_size, rows)]
    return [spec for i, spec in enumerate(specs) if spec not in specs[:i]]


class MedusaKind(HeadKind):
    """Medusa-1 heads (FasterDecoding's or vLLM's names): one call drafts ``num_heads`` tokens, no KV."""

    layout = "medusa"
    method = "medusa"
    expects = f"Medusa's {MEDUSA_WEIGHTS[0]} (or a config.json with medusa_num_heads / num_heads)"

    def detect(self, folder: Path, config: dict | None) -> bool:
        if any((folder / name).is_file() for name in MEDUSA_WEIGHTS):
            return True
        return config is not None and ("medusa_num_heads" in config or "num_heads" in config)

    def load(self, folder: Path, target) -> MedusaHead:
        return load_medusa(folder, target)

    def hidden_size(self, head) -> int:
        return head.hidden_size

    def prepare(self, head) -> None:
        head.share_equal_lm_heads()  # one table in the graph, not one per head

    def trace(self, head, config: SpecializationConfig) -> TracedHead:
        from qspec.heads import export

        return TracedHead(export.trace_medusa(head), [contract.HIDDEN_STATES], [contract.LOGITS])

    def specializations(self, head, config: SpecializationConfig) -> list[Specialization]:
        return medusa_specializations(config)

    def write_specializations(self, specs: list[Specialization], path: Path, fmt: str) -> None:
        """The graph has only ``batch_size``: the file names only that symbol."""
        symbols = [{contract.BATCH_SIZE: str(spec.batch_size)} for spec in specs]
        entries = (
            [{"name": f"Batch_{s[contract.BATCH_SIZE]}", "symbols": s} for s in symbols] if fmt == "named" else symbols
        )
        write_text_atomic(path, json.dumps({"specializations": entries}, indent=2) + "\n")

    def custom_io(self, kv_dtype: str) -> str:
        """The features it reads, in ``kv_dtype`` (as the target's ``hidden_states`` output)."""
        return f" - IOName: {contract.HIDDEN_STATES}\n   Precision: {kv_dtype}\n\n"

    def manifest_fields(self, head, config: SpecializationConfig) -> dict:
        return {"num_heads": head.num_heads, "num_layers": head.num_layers}


class TurboKind(MedusaKind):
    """QEfficient's turbo projections: Medusa's graph over the target's LM head."""

    layout = "turbo"
    expects = f"turbo's {TURBO_CONFIG} + {TURBO_WEIGHTS}"

    def detect(self, folder: Path, config: dict | None) -> bool:
        return (folder / TURBO_CONFIG).is_file()

    def load(self, folder: Path, target) -> MedusaHead:
        return load_turbo(folder, target)


MEDUSA = MedusaKind()
TURBO = TurboKind()
