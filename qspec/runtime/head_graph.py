"""A draft head's graph loaded in ONNX Runtime (:class:`HeadGraph`), its KV cache (EAGLE) resident and bound in
place; :func:`qspec.runtime.load.load_head_graph` opens it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from qspec import contract
from qspec.backends import ort as ort_backend
from qspec.backends import ort_plan


class HeadGraph:
    """A head's ONNX graph in ONNX Runtime, its KV cache (EAGLE) resident and bound in place."""

    def __init__(self, path: Path, *, rows: int, kv: tuple[int, int, int] | None, num_threads: int | None = 1):
        # One thread by default: a head call is small, and a pool of its own would fight the target's
        # spinning threads for the cores between the target's calls.
        options = ort_backend.session_options({}, spinning=False, num_threads=num_threads)
        self.session = ort.InferenceSession(str(path), options, providers=ort_backend.PROVIDERS)
        names = {i.name for i in self.session.get_inputs()}
        self.batch_index = contract.BATCH_INDEX in names
        self.kv_values = []
        if kv is not None:
            kv_heads, slots, head_dim = kv
            shape = (rows, kv_heads, slots, head_dim)
            self.kv_values = [
                (name, ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))) for name in contract.kv_names(1)
            ]
        self.outputs = [
            o.name for o in self.session.get_outputs() if not o.name.endswith(contract.RETAINED_STATE_SUFFIX)
        ]
        self.plan_names = ort_plan.plan_names(names)  # a one-slot EAGLE head's (qspec.heads.ort_graph)
        self._bound: dict[tuple, _Bound] = {}  # input shapes -> their binding (a few: rows x widths)

    def run(self, feeds: dict[str, np.ndarray], *, keep: int = 1) -> dict[str, np.ndarray]:
        """One call; the outputs are the graph's, valid until the next call of the same input shapes. ``keep``:
        each row's last live rows returned (a one-slot EAGLE head's; a parallel head's K drafts)."""
        key = (keep, *((name, value.shape) for name, value in feeds.items()))
        bound = self._bound.get(key)
        if bound is None:
            self._bound[key] = bound = self._bind(feeds, keep)  # runs the call
            return bound.outputs
        for name, value in feeds.items():
            np.copyto(bound.inputs[name], value)
        if bound.plan is not None:
            bound.plan.write(bound.inputs[contract.POSITION_IDS])
        self.session.run_with_iobinding(bound.binding)
        return bound.outputs

    def _bind(self, feeds: dict[str, np.ndarray], keep: int) -> _Bound:
        """An IO binding for calls of ``feeds``' shapes, made by running the call on ``feeds``: host arrays for the
        inputs, and for the outputs once that call has given their shapes (and values); the KV cache in place."""
        binding = self.session.io_binding()
        inputs = {name: np.array(value) for name, value in feeds.items()}
        plan = None
        if self.plan_names:
            positions = inputs[contract.POSITION_IDS]
            plan = ort_plan.CallPlan(positions.shape[0], positions.shape[1], keep, self.plan_names)
            plan.write(positions)
        keep = [ort.OrtValue.ortvalue_from_numpy(value) for value in inputs.values()]
        for name, value in zip(inputs, keep):
            binding.bind_ortvalue_input(name, value)
        for name, array in (plan.arrays if plan else {}).items():
            keep.append(ort.OrtValue.ortvalue_from_numpy(array))
            binding.bind_ortvalue_input(name, keep[-1])
        for name, value in self.kv_values:
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(contract.retained(name), value)
        for name in self.outputs:
            binding.bind_output(name)
        self.session.run_with_iobinding(binding)
        produced = binding.get_outputs()[-len(self.outputs) :]
        outputs = {name: value.numpy() for name, value in zip(self.outputs, produced)}
        binding.clear_binding_outputs()
        for name, value in self.kv_values:
            binding.bind_ortvalue_output(contract.retained(name), value)
        for name, array in outputs.items():
            keep.append(ort.OrtValue.ortvalue_from_numpy(array))
            binding.bind_ortvalue_output(name, keep[-1])
        return _Bound(binding, inputs, outputs, keep, plan)


@dataclass
class _Bound:
    """One input shape's IO binding with the host arrays its OrtValues wrap."""

    binding: ort.IOBinding
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    keep: list  # the OrtValues, alive as long as the binding
    plan: ort_plan.CallPlan | None  # its call plan's arrays, rewritten before each call
