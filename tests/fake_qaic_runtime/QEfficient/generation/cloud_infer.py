"""Stand-in for QEfficient's ``QAICInferenceSession`` (tests only): the session's rules, ONNX Runtime's math.

It runs the network the stand-in ``qaic-compile`` recorded in ``<qpc>/fake_qaic_argv.json`` (paths
relative to the package holding the QPC, as the real QPC carries its network) and enforces what the
real session (over the SDK's ``qaicrt``) enforces:

- a call runs only with buffers whose shapes are those of one compiled specialization (the device
  picks the specialization from them); anything else fails, listing the allowed shapes;
- every input is either bound (``set_buffers`` / ``run``'s inputs) or skipped; a skipped buffer
  cannot be bound afterwards and is never returned: reading it back raises;
- the retained state (each ``past_*`` input and its ``_RetainedState`` output) lives on the
  "device": every call reads it and writes it back in place, nothing is copied to the host.
"""

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

RETAINED = "_RetainedState"


class SkippedBuffers(dict):
    """Outputs of a call; a skipped buffer stays on the device and cannot be read back."""

    def __init__(self, values, skipped):
        super().__init__(values)
        self.skipped = skipped

    def __getitem__(self, name):
        if name in self.skipped:
            raise KeyError(f"{name} was skipped: it stays on the device and is never read back")
        return super().__getitem__(name)


def _read_specializations(path):
    entries = json.loads(Path(path).read_text())["specializations"]
    return [{k: int(v) for k, v in entry.get("symbols", entry).items()} for entry in entries]


class QAICInferenceSession:
    def __init__(self, qpc_path, device_ids=None, activate=True, enable_debug_logs=False):
        qpc = Path(qpc_path)
        if not (qpc / "programqpc.bin").is_file():
            raise RuntimeError(f"Failed to load program: no programqpc.bin in {qpc}")
        record = json.loads((qpc / "fake_qaic_argv.json").read_text())
        flags = dict(arg.split("=", 1) for arg in record["argv"] if "=" in arg)
        cwd = qpc.parent  # the compiler ran in the package folder (since moved into place), paths relative to it
        self.specializations = _read_specializations(cwd / flags["-network-specialization-config"])
        fixed = {k: v for k, v in self.specializations[0].items() if k in ("ctx_len", "full_batch_size")}
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1
        for key, value in fixed.items():
            options.add_free_dimension_override_by_name(key, value)
        self._ort = ort.InferenceSession(os.fspath(cwd / flags["-m"]), options, providers=["CPUExecutionProvider"])
        self._dims = {v.name: list(v.shape) for v in self._ort.get_inputs() + self._ort.get_outputs()}
        self.input_names = [v.name for v in self._ort.get_inputs()]
        self.output_names = [v.name for v in self._ort.get_outputs()]
        self.allowed_shapes = [self._shapes(spec) for spec in self.specializations]
        first = self.allowed_shapes[0]
        self._device = {n: np.zeros(first[n], dtype=np.float32) for n in self.input_names if n + RETAINED in self._dims}
        self._buffers = {}
        self._skipped = set()

    def _shapes(self, spec):
        """Every binding's shape under ``spec`` (a symbolic dimension the spec does not name is free)."""
        return {name: [spec.get(d, d) if isinstance(d, str) else d for d in dims] for name, dims in self._dims.items()}

    def set_buffers(self, buffers):
        for name, buffer in buffers.items():
            if name not in self._dims:
                raise KeyError(f'Buffer: "{name}" not found')
            if name in self._skipped:
                raise ValueError(f"{name} is skipped: its data stays on the device")
            self._buffers[name] = np.array(buffer)  # the real session copies host buffers to the device

    def skip_buffers(self, skipped_buffer_names):
        for name in skipped_buffer_names:
            if name not in self._dims:
                raise KeyError(f'Buffer: "{name}" not found')
            self._buffers.pop(name, None)
            self._skipped.add(name)

    def _matching_specialization(self):
        bound = {name: list(buf.shape) for name, buf in self._buffers.items()}
        for shapes in self.allowed_shapes:
            if all(
                all(isinstance(w, str) or w == b for w, b in zip(shapes[n], dims)) and len(shapes[n]) == len(dims)
                for n, dims in bound.items()
            ):
                return shapes
        allowed = "; ".join(str({n: s[n] for n in bound}) for s in self.allowed_shapes)
        raise ValueError(
            f"Failed to run: no compiled specialization matches the bound shapes {bound}; allowed: {allowed}"
        )

    def run(self, inputs):
        self.set_buffers(inputs)
        for name in self.input_names:
            if name not in self._buffers and name not in self._skipped:
                raise ValueError(f"Failed to run: input {name} has neither a buffer nor skip_buffers")
        self._matching_specialization()
        feeds = {n: self._buffers.get(n, self._device.get(n)) for n in self.input_names}
        values = dict(zip(self.output_names, self._ort.run(self.output_names, feeds)))
        for name in self._device:
            self._device[name] = values[name + RETAINED]  # retained state: written back on the device
        outputs = {n: v for n, v in values.items() if n not in self._skipped}
        return SkippedBuffers(outputs, self._skipped)
