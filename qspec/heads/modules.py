"""Draft heads as torch modules, and the checkpoint layouts other tools read and write: the public names of
every kind's module (:mod:`qspec.heads.eagle`, :mod:`qspec.heads.medusa`; :data:`qspec.heads.kinds.KINDS`
lists them), from one place.

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

from pathlib import Path

from torch import nn

# The layouts' public names, from one module (each kind lives in its own: qspec.heads.kinds lists them).
from qspec.heads.checkpoint import d2t_from_ids, ids_from_d2t, t2d_from_ids  # noqa: F401
from qspec.heads.eagle import (  # noqa: F401
    EAGLE_CONFIG,
    EAGLE_WEIGHTS,
    TABLES,
    EagleHead,
    eagle_config,
    eagle_from_target,
    load_eagle,
    save_eagle,
)
from qspec.heads.medusa import (  # noqa: F401
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

# Any layout -------------------------------------------------------------------------------------------


def detect_layout(head_dir: str | Path) -> str:
    """The layout name of the head in ``head_dir`` (a key of :data:`qspec.heads.kinds.KINDS`)."""
    from qspec.heads.kinds import detect_kind

    return detect_kind(head_dir).layout


def load_head(head_dir: str | Path, target_model=None) -> tuple[nn.Module, str]:
    """Any supported head and its layout name (see :func:`detect_layout`)."""
    from qspec.heads.kinds import load_head as load

    head, kind = load(head_dir, target_model)
    return head, kind.layout
