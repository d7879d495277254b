"""The table of draft-head kinds: one :class:`~qspec.heads.kind.HeadKind` per checkpoint layout, one module each.

=============  ==========================  =======  =====================================================
layout         module                      method   detected by
=============  ==========================  =======  =====================================================
deepseek-mtp   :mod:`qspec.heads.mtp`      mtp      a model folder with ``model.layers.{L}.eh_proj``
mimo-mtp       :mod:`qspec.heads.mtp`      mtp      a model folder with ``model.mtp_layers.0.input_proj``
turbo          :mod:`qspec.heads.medusa`   medusa   ``speculator_config.json``
medusa         :mod:`qspec.heads.medusa`   medusa   ``medusa_lm_head.*``, or ``medusa_num_heads``
eagle3         :mod:`qspec.heads.eagle3`   eagle    ``LlamaForCausalLMEagle3``, or speculators' ``eagle3``
eagle          :mod:`qspec.heads.eagle`    eagle    ``config.json`` with one layer
=============  ==========================  =======  =====================================================

Detection tries the kinds in the table's order (the more specific first). ``method`` is the runtime proposer
(:data:`qspec.runtime.heads.HEAD_PROPOSERS`); ``tests/test_heads_modules.py`` checks that every kind's has one.
"""

from __future__ import annotations

from pathlib import Path

from qspec.errors import ModelLoadError
from qspec.heads.checkpoint import read_json
from qspec.heads.eagle import EAGLE
from qspec.heads.eagle3 import EAGLE3
from qspec.heads.kind import HeadKind
from qspec.heads.medusa import MEDUSA, TURBO
from qspec.heads.mtp import DEEPSEEK_MTP, MIMO_MTP

CONFIG = "config.json"
KINDS: dict[str, HeadKind] = {kind.layout: kind for kind in (DEEPSEEK_MTP, MIMO_MTP, TURBO, MEDUSA, EAGLE3, EAGLE)}


def head_config(head_dir: str | Path) -> dict | None:
    """The folder's ``config.json`` as a dict, None without one."""
    path = Path(head_dir) / CONFIG
    return read_json(path) if path.is_file() else None


def detect_kind(head_dir: str | Path) -> HeadKind:
    """The kind of the head in ``head_dir``, or an error naming what each kind expects."""
    folder = Path(head_dir)
    config = head_config(folder)
    for kind in KINDS.values():
        if kind.detect(folder, config):
            return kind
    expected = "; ".join(kind.expects for kind in KINDS.values())
    raise ModelLoadError(f"{folder} holds no draft head: expected {expected}")


def load_head(head_dir: str | Path, target_model=None):
    """Any supported head and its kind."""
    kind = detect_kind(head_dir)
    return kind.load(Path(head_dir), target_model), kind
