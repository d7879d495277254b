"""What every draft-head layout shares: the reduced draft vocabulary (EAGLE-3's ``d2t`` / ``t2d``, vLLM's
``token_map``), frozen tables, and reading checkpoint files (:mod:`qspec.heads.modules`, :mod:`qspec.heads.medusa`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from qspec.errors import ConfigError, ModelLoadError

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


def check_draft_ids(draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    if draft_ids is None:
        return None
    ids = torch.as_tensor(draft_ids, dtype=torch.long).flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ConfigError(f"draft ids must be target token ids in [0, {vocab_size}); got {ids.numel()} ids")
    if ids.unique().numel() != ids.numel():
        raise ConfigError("draft ids repeat a target id; give each target id at most once")
    return ids


def draft_rows(table: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The LM-head rows of the draft vocabulary: ``table`` itself if it already has one row per draft id."""
    table = table.detach().float()
    if draft_ids is None or table.shape[0] == draft_ids.numel():
        return table.clone()
    return table[draft_ids].clone()


def frozen_linear(rows: torch.Tensor) -> nn.Linear:
    """``nn.Linear`` computing ``x @ rows.T``, not trained."""
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
    linear.weight = nn.Parameter(rows, requires_grad=False)
    return linear


# Checkpoint files ---------------------------------------------------------------------------------------


def load_exact(
    head: nn.Module,
    state: dict[str, torch.Tensor],
    folder: Path,
    *,
    skip: tuple[str, ...],
    problem: str = "does not match its config",
) -> None:
    """Load ``state`` (as fp32) into ``head``; any key missing (but ``skip``) or unexpected is an error."""
    result = head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = sorted(set(result.missing_keys) - set(skip))
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"{folder} {problem}: missing {missing or 'nothing'}, "
            f"unexpected {sorted(result.unexpected_keys) or 'nothing'}"
        )


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; give the folder of a head checkpoint")
    return json.loads(path.read_text())


def read_weights(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
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


# Keys of transformers' base config that a head's reader needs (the rest of the base is boilerplate).
_BASE_KEPT = frozenset(
    {"architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"}
)


def clean_config(values: dict) -> dict:
    """A head's ``config.json`` without what would tie it to a machine or a library version: private keys
    (``_name_or_path`` holds the path the target was loaded from), ``transformers_version``, ``dtype`` (the
    file's ``torch_dtype`` says it) and the base config's generic fields (``id2label``, ``return_dict``, ...).

    >>> clean_config({"_name_or_path": "/home/me/model", "hidden_size": 64, "return_dict": True, "dtype": "float32"})
    {'hidden_size': 64}
    """
    from transformers import PretrainedConfig

    boilerplate = (set(PretrainedConfig().to_dict()) - _BASE_KEPT) | {"transformers_version", "dtype"}
    return {k: v for k, v in values.items() if not k.startswith("_") and k not in boilerplate}
