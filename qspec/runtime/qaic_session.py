"""The ``qaic`` runtime backend: a package's QPC on Cloud AI 100, driven like QEfficient drives it.

A QAIC session (QEfficient's ``QAICInferenceSession`` over the SDK's ``qaicrt``) holds buffers by
name. qspec uses it the way QEfficient's generation loop does:

- ``skip_buffers`` on every ``past_*`` input and ``past_*_RetainedState`` output: the KV cache is
  the device's retained state, updated in place by every call and never copied to the host;
- per call, ``set_buffers`` binds the ``logits`` output array and ``run`` the small inputs
  (``input_ids``, ``position_ids``, ``batch_index``, ``num_logits_to_keep``); the session picks
  the compiled specialization whose shapes match those buffers (no match: the call fails).

The vendor's Python runtime is imported only here, and only when a package is loaded with
``backend="qaic"``; without it the error says what to install.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np

from qspec import contract
from qspec.backends.qaic import QPC_DIR, QPC_PROGRAM
from qspec.errors import QSpecError
from qspec.runtime.session import Binding, LoadedModel, host_arrays
from qspec.runtime.tree_inputs import write_moves, write_tree_inputs

SESSION_MODULE = "QEfficient.generation.cloud_infer"  # where QAICInferenceSession lives
SESSION_CLASS = "QAICInferenceSession"


class QaicRuntimeError(QSpecError):
    """The QAIC runtime is missing, or the package has no QPC to run."""


def session_class() -> type:
    """QEfficient's ``QAICInferenceSession``, or a one-line error saying what is missing."""
    try:
        module = importlib.import_module(SESSION_MODULE)
    except ImportError as exc:
        raise QaicRuntimeError(
            f"backend qaic needs the Cloud AI 100 Python runtime ({SESSION_MODULE}.{SESSION_CLASS} over qaicrt), "
            f"which is not importable ({exc}); install the Platform SDK and QEfficient, or run with backend ort"
        ) from None
    return getattr(module, SESSION_CLASS)


def qpc_path(model: LoadedModel) -> Path:
    """The package's compiled QPC folder, or a one-line error with the way to build it."""
    qaic = model.manifest.qaic
    if model.manifest.backend != "qaic" or qaic is None:
        raise QaicRuntimeError(
            f"package {model.package} was compiled for {model.manifest.backend}, it has no QPC; "
            "compile it with `qspec compile --backend qaic`"
        )
    folder = model.package / (qaic.qpc_dir or QPC_DIR)
    if not (folder / QPC_PROGRAM).is_file():
        raise QaicRuntimeError(
            f"package {model.package} has no {folder.name}/{QPC_PROGRAM}: run {model.package / qaic.script} "
            "on a machine with the SDK"
        )
    return folder


class QaicModel(LoadedModel):
    """A package's QPC loaded in a QAIC session, its KV cache resident on the device.

    ``session_mode``, ``spinning`` and ``num_threads`` are ONNX Runtime's host options; they do not
    apply to the device and are accepted only so that callers need not know the backend.
    """

    def __init__(
        self,
        package: str | Path,
        *,
        device_ids: list[int] | None = None,
        session_mode: Any = None,
        spinning: Any = None,
        num_threads: Any = None,
    ):
        self._read_package(package)
        session_type = session_class()
        try:
            self.session = session_type(str(qpc_path(self)), device_ids=device_ids)
        except ImportError as exc:  # QEfficient imports without qaicrt and fails when a session starts
            raise QaicRuntimeError(
                f"backend qaic: the QAIC runtime cannot start ({exc}); install the Platform SDK"
            ) from None
        self.kv_names = self.manifest.model.kv_names()
        # The KV cache stays on the device: neither written from nor read back to the host.
        self.session.skip_buffers(self.kv_names + [contract.retained(name) for name in self.kv_names])
        # A vendor graph with tree inputs verifies trees; an accepted sibling's KV is copied on the device by the
        # next call that runs its KV row (kv_moves), as the ort backend copies it on the host.
        self.verifies_trees = self.manifest.model.tree_inputs
        self._moves: dict[int, list[tuple[int, int]]] = {}  # KV row -> slot copies the next call makes
        self.bindings = {
            spec: Binding(
                spec,
                **host_arrays(
                    spec, self.vocab_size, continuous_batching=self.continuous_batching, tree_inputs=self.verifies_trees
                ),
            )
            for spec in self.manifest.specializations
        }
        self._index()

    def move_kv(self, slot: int, moves: list[tuple[int, int]]) -> None:
        if not self.verifies_trees:
            super().move_kv(slot, moves)
        self._moves[slot] = self._moves.get(slot, []) + moves

    def _tree_inputs(self, bound: Binding) -> dict[str, np.ndarray]:
        """The call's tree inputs; each call row takes its KV row's pending copies (the copies are then made)."""
        write_tree_inputs(bound.position_ids, bound.tree)
        kv_rows = bound.batch_index[:, 0].tolist() if bound.batch_index is not None else range(bound.spec.batch_size)
        write_moves(bound.tree[contract.KV_MOVES], [self._moves.pop(row, []) for row in kv_rows])
        return bound.tree

    def run(self, bound: Binding) -> np.ndarray:
        inputs = {contract.INPUT_IDS: bound.input_ids, contract.POSITION_IDS: bound.position_ids}
        if bound.batch_index is not None:
            inputs[contract.BATCH_INDEX] = bound.batch_index
        if bound.comp_ctx_lengths is not None:  # only its length matters: it selects the bucket
            inputs[contract.COMP_CTX_LENGTHS] = bound.comp_ctx_lengths
        if self.speculative:  # only its shape matters: it selects the specialization
            inputs[contract.NUM_LOGITS_TO_KEEP] = np.zeros((bound.logits.shape[1], 1), dtype=np.int64)
        if bound.tree is not None:
            inputs.update(self._tree_inputs(bound))
        self.session.set_buffers({contract.LOGITS: bound.logits})
        outputs = self.session.run(inputs)
        bound.logits[...] = outputs[contract.LOGITS]
        if contract.HIDDEN_STATES in outputs:  # a package compiled for a draft head
            bound.hidden_states = np.asarray(outputs[contract.HIDDEN_STATES], dtype=np.float32)
        return bound.logits
