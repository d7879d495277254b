"""A compiled package loaded into ONNX Runtime: KV buffers resident, one IO binding per specialization.

The KV cache is ``2 * num_layers`` OrtValues of ``[rows, kv_heads, ctx_len, head_dim]``, allocated
once. Every specialization's binding binds each ``past_*`` input **and** its ``_RetainedState``
output to the same OrtValue, so a call updates the cache in place (ORT then skips the copy in its
scatter) and nothing is copied between calls. The small inputs (token ids, positions, batch index)
and the logits are numpy arrays wrapped, not copied, by OrtValues bound once: a call writes the
inputs in place and reads the logits in place.

Session modes (see ``qspec.backends.ort`` and the closing notes for the measurements):

- ``shared`` (default): one session for the whole package, ``ctx_len`` (and ``full_batch_size``)
  fixed, ``batch_size``/``seq_len``/``num_logits_to_keep`` taken from the bound specialization. The
  weights are loaded and pre-packed once, so five specializations cost the memory of one.
- ``static``: one static-shape session per specialization (every dimension fixed); their thread
  pools do not spin, so an idle session never steals the cores of the one that runs. Each session pre-packs its own weights (+≈0.5 GB each for SmolLM2); ONNX
  Runtime's Python API has no shared pre-packed weight container, and without pre-packing a call is
  ≈1.8× slower.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import onnxruntime as ort

from qspec import contract
from qspec.backends import ort as ort_backend
from qspec.package import ONNX_FILE, Manifest, check_package
from qspec.specializations import Specialization

SessionMode = Literal["shared", "static"]


@dataclass
class Binding:
    """One specialization's IO binding and the numpy arrays behind its small inputs and logits."""

    spec: Specialization
    session: ort.InferenceSession
    binding: ort.IOBinding
    input_ids: np.ndarray  # [batch_size, seq_len]
    position_ids: np.ndarray  # [batch_size, seq_len]
    batch_index: np.ndarray | None  # [batch_size, 1]
    logits: np.ndarray  # [batch_size, num_logits_to_keep, vocab]
    keep: list = field(default_factory=list)  # OrtValues that must outlive the binding

    def reset(self) -> None:
        """Every row padding: token 0 at PAD_POSITION."""
        self.input_ids.fill(0)
        self.position_ids.fill(contract.PAD_POSITION)


class CompiledModel:
    """A package's graph on ONNX Runtime with its KV cache; ``run(binding)`` is one call."""

    def __init__(
        self,
        package: str | Path,
        *,
        session_mode: SessionMode = "shared",
        spinning: bool = True,
        num_threads: int | None = None,
    ):
        self.package = Path(package)
        self.manifest: Manifest = check_package(self.package)
        self.session_mode = session_mode
        model = self.manifest.model
        specs = self.manifest.specializations
        self.prefill_spec = specs[0]
        self.decode_specs: dict[int, Specialization] = {}
        for spec in specs[1:]:
            self.decode_specs.setdefault(spec.num_speculative_tokens, spec)
        if not self.decode_specs:  # prefill_seq_len == 1 and only K=0: the one shape serves both
            self.decode_specs[0] = specs[0]
        self.ks = sorted(self.decode_specs)
        self.ctx_len = self.prefill_spec.ctx_len
        self.rows = self.prefill_spec.full_batch_size or max(s.batch_size for s in specs)
        self.continuous_batching = model.continuous_batching
        self.speculative = model.speculative
        self.vocab_size = model.vocab_size

        begin = time.perf_counter()
        onnx_path = self.package / ONNX_FILE
        sessions: dict[Specialization, ort.InferenceSession] = {}
        if session_mode == "shared":
            fixed = {contract.CTX_LEN: self.ctx_len}
            if self.continuous_batching:
                fixed[contract.FULL_BATCH_SIZE] = self.rows
            session = ort.InferenceSession(
                str(onnx_path),
                ort_backend.session_options(fixed, spinning=spinning, num_threads=num_threads),
                providers=ort_backend.PROVIDERS,
            )
            sessions = {spec: session for spec in specs}
        elif session_mode == "static":
            for spec in specs:
                # Several sessions in one process: none spins, so an idle one never steals the cores.
                sessions[spec] = ort_backend.create_session(onnx_path, spec, spinning=False, num_threads=num_threads)
        else:
            raise ValueError(f"session_mode {session_mode!r}: use 'shared' or 'static'")
        self.load_seconds = time.perf_counter() - begin

        dtype = np.float16 if model.kv_dtype == "float16" else np.float32
        shape = (self.rows, model.num_kv_heads, self.ctx_len, model.head_dim)
        self.kv_names = contract.kv_names(model.num_layers)
        self.kv = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=dtype)) for _ in self.kv_names]
        self.bindings: dict[Specialization, Binding] = {spec: self._bind(spec, sessions[spec]) for spec in specs}
        self.prefill = self.bindings[self.prefill_spec]
        self.decode = {k: self.bindings[spec] for k, spec in self.decode_specs.items()}

    def _bind(self, spec: Specialization, session: ort.InferenceSession) -> Binding:
        binding = session.io_binding()
        rows, seq = spec.batch_size, spec.seq_len
        input_ids = np.zeros((rows, seq), dtype=np.int64)
        position_ids = np.full((rows, seq), contract.PAD_POSITION, dtype=np.int64)
        keep_n = spec.num_logits_to_keep or 1
        logits = np.zeros((rows, keep_n, self.vocab_size), dtype=np.float32)
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (input_ids, position_ids, logits)]
        binding.bind_ortvalue_input(contract.INPUT_IDS, values[0])
        binding.bind_ortvalue_input(contract.POSITION_IDS, values[1])
        binding.bind_ortvalue_output(contract.LOGITS, values[2])
        batch_index = None
        if self.continuous_batching:
            batch_index = np.arange(rows, dtype=np.int64)[:, None]
            values.append(ort.OrtValue.ortvalue_from_numpy(batch_index))
            binding.bind_ortvalue_input(contract.BATCH_INDEX, values[-1])
        if self.speculative:
            values.append(ort.OrtValue.ortvalue_from_numpy(np.zeros((keep_n, 1), dtype=np.int64)))
            binding.bind_ortvalue_input(contract.NUM_LOGITS_TO_KEEP, values[-1])
        for name, value in zip(self.kv_names, self.kv):
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(contract.retained(name), value)
        return Binding(spec, session, binding, input_ids, position_ids, batch_index, logits, values)

    def run(self, bound: Binding) -> np.ndarray:
        """One call with the inputs written into ``bound``'s arrays; returns its logits array."""
        bound.session.run_with_iobinding(bound.binding)
        return bound.logits

    def weight_bytes(self) -> int:
        """Bytes of the weights streamed by every call (the memory-bandwidth floor's numerator)."""
        return sum(p.stat().st_size for p in self.package.glob(ONNX_FILE + "*"))

