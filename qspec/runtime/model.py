"""The ``ort`` runtime backend: a package in ONNX Runtime, KV buffers resident, one IO binding per specialization.

:class:`CompiledModel` implements :class:`~qspec.runtime.session.LoadedModel` (the interface the
engine uses, whatever the backend).

The KV cache is ``2 * num_layers`` OrtValues of ``[rows, kv_heads, ctx_len, head_dim]`` (plus slack
slots for a GroupQueryAttention graph, :attr:`CompiledModel.kv_len`), allocated once. Every
specialization's binding binds each ``past_*`` input **and** its ``_RetainedState`` output to the
same OrtValue, so a call updates the cache in place (the scatter of an explicit-attention graph
skips its copy; GroupQueryAttention writes into the shared buffer) and nothing is copied between
calls. The small inputs (token ids, positions, batch index) and the logits are numpy arrays wrapped,
not copied, by OrtValues bound once: a call writes the inputs in place and reads the logits in place.

Session modes (see ``qspec.backends.ort`` for the measurements):

- ``shared`` (default): one session for the whole package, ``ctx_len`` (and ``full_batch_size``)
  fixed, ``batch_size``/``seq_len``/``num_logits_to_keep`` taken from the bound specialization. The
  weights are loaded and pre-packed once, so five specializations cost the memory of one.
- ``static``: one static-shape session per specialization (every dimension fixed); their thread
  pools do not spin, so an idle session never steals the cores of the one that runs. Each session
  pre-packs its own weights (ONNX Runtime's Python API has no shared pre-packed weight container,
  and a call without pre-packing is much slower): memory grows with the specializations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from qspec import contract
from qspec.backends import ort as ort_backend
from qspec.backends.ort_lanes import softmax_lanes
from qspec.backends.ort_plan import CallPlan, op_slots, plan_names
from qspec.errors import PackageError
from qspec.package import ONNX_FILE, runtime_graph_file
from qspec.runtime.session import Binding, LoadedModel, SessionMode, host_arrays
from qspec.runtime.tree_inputs import write_tree_inputs
from qspec.specializations import Specialization


@dataclass
class OrtBinding(Binding):
    """A specialization's host arrays wrapped (not copied) by OrtValues bound to its session's IO binding."""

    session: ort.InferenceSession | None = None
    binding: ort.IOBinding | None = None
    keep: list = field(default_factory=list)  # OrtValues that must outlive the binding
    plan: CallPlan | None = None  # a trimmed graph's per-call inputs, written from position_ids before each call


class CompiledModel(LoadedModel):
    """A package's graph on ONNX Runtime with its KV cache; ``run(binding)`` is one call."""

    def __init__(
        self,
        package: str | Path,
        *,
        session_mode: SessionMode = "shared",
        spinning: bool = True,
        num_threads: int | None = None,
        vendor_graph: bool = False,
        prefill_seq_len: int | None = None,
    ):
        """``vendor_graph``: run ``model.onnx`` (the contract graph the ``qaic`` backend compiles, explicit
        attention over the compute-context-length slots) instead of the package's runtime graph; the
        bench times it to show what the buckets save on that graph.
        ``prefill_seq_len``: prefill in chunks of that many tokens instead of the package's: what the
        package compiled with ``--prefill-seq-len`` would run (its graphs take any ``seq_len``); the
        bench times TTFT per chunk size with it."""
        self._read_package(package, prefill_seq_len)
        if vendor_graph and not self.manifest.vendor_graph:
            raise PackageError(
                f"{self.package} holds no {ONNX_FILE} (an ort package ships its runtime graph only); "
                "compile it with --vendor-graph"
            )
        self.session_mode = session_mode
        model = self.manifest.model
        specs = self.specs

        graph = None if vendor_graph else self.manifest.runtime_graph
        self.packs_live_tokens = graph is not None and graph.packs_live_tokens
        # A tree graph places an off-chain draft a softmax lane group past its depth (ort_plan.op_slots): the
        # kernel's lane count, probed once; trees stay off where no count up to TREE_LANES_MAX is exact.
        self.lanes = softmax_lanes() if graph is not None and graph.verifies_trees else None
        # The vendor graph with tree inputs (backend qaic's) verifies trees at any lane count: slots come from the host.
        self.tree_inputs = graph is None and self.manifest.model.tree_inputs
        self.verifies_trees = self.lanes is not None or self.tree_inputs
        # GroupQueryAttention wants room for a whole padded chunk past a row's first position (see
        # RuntimeGraph.kv_slack); positions stay < ctx_len.
        slack = graph.kv_slack(max(s.seq_len for s in specs)) if graph is not None else 0
        self.kv_len = self.ctx_len + slack
        if slack and self.kv_len > graph.rope_positions:
            raise PackageError(
                f"{self.package}: its graph's RoPE table has {graph.rope_positions} positions, fewer than "
                f"ctx_len + seq_len = {self.kv_len}; compile the package again"
            )

        begin = time.perf_counter()
        onnx_path = self.package / (ONNX_FILE if vendor_graph else runtime_graph_file(self.manifest))
        sessions: dict[Specialization, ort.InferenceSession] = {}
        if session_mode == "shared":
            fixed = {contract.CTX_LEN: self.kv_len}
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
                padded = self._session_spec(spec)
                sessions[spec] = ort_backend.create_session(onnx_path, padded, spinning=False, num_threads=num_threads)
        else:
            raise ValueError(f"session_mode {session_mode!r}: use 'shared' or 'static'")
        self.load_seconds = time.perf_counter() - begin

        dtype = np.float16 if model.kv_dtype == "float16" else np.float32
        shape = (self.rows, model.num_kv_heads, self.kv_len)
        self.kv_names = model.kv_names()
        # The OrtValues wrap these arrays (no copy): move_kv writes the cache through them.
        self.kv_arrays = [np.zeros((*shape, w), dtype=dtype) for w in model.kv_widths()]
        self.kv = [ort.OrtValue.ortvalue_from_numpy(array) for array in self.kv_arrays]
        self.bindings: dict[Specialization, OrtBinding] = {spec: self._bind(spec, sessions[spec]) for spec in specs}
        self._index()
        # One session with free seq_len over a graph that packs live tokens and keeps a KV row per slot: a
        # decode call can take a prompt chunk beside the live rows at the cost of the chunk's tokens.
        self.mixes_prefill = session_mode == "shared" and self.continuous_batching and self.packs_live_tokens
        self._mixed: dict[Specialization, OrtBinding] = {}

    def _session_spec(self, spec: Specialization) -> Specialization:
        """``spec`` as the session runs it: ``ctx_len`` is :attr:`kv_len`."""
        return spec.model_copy(update={"ctx_len": self.kv_len})

    def _bind(self, spec: Specialization, session: ort.InferenceSession) -> OrtBinding:
        arrays = host_arrays(
            self._session_spec(spec),
            self.vocab_size,
            continuous_batching=self.continuous_batching,
            tree_inputs=self.tree_inputs,
        )
        binding = session.io_binding()
        values = [ort.OrtValue.ortvalue_from_numpy(arrays[name]) for name in ("input_ids", "position_ids", "logits")]
        binding.bind_ortvalue_input(contract.INPUT_IDS, values[0])
        binding.bind_ortvalue_input(contract.POSITION_IDS, values[1])
        binding.bind_ortvalue_output(contract.LOGITS, values[2])
        if arrays["batch_index"] is not None:
            values.append(ort.OrtValue.ortvalue_from_numpy(arrays["batch_index"]))
            binding.bind_ortvalue_input(contract.BATCH_INDEX, values[-1])
        if arrays["comp_ctx_lengths"] is not None:
            values.append(ort.OrtValue.ortvalue_from_numpy(arrays["comp_ctx_lengths"]))
            binding.bind_ortvalue_input(contract.COMP_CTX_LENGTHS, values[-1])
        hidden = next((o for o in session.get_outputs() if o.name == contract.HIDDEN_STATES), None)
        if hidden is not None:
            rows, seq = arrays["input_ids"].shape
            arrays["hidden_states"] = np.zeros((rows, seq, hidden.shape[-1]), dtype=np.float32)
            values.append(ort.OrtValue.ortvalue_from_numpy(arrays["hidden_states"]))
            binding.bind_ortvalue_output(contract.HIDDEN_STATES, values[-1])
        if self.speculative:
            keep_n = arrays["logits"].shape[1]
            values.append(ort.OrtValue.ortvalue_from_numpy(np.zeros((keep_n, 1), dtype=np.int64)))
            binding.bind_ortvalue_input(contract.NUM_LOGITS_TO_KEEP, values[-1])
        for name, array in (arrays["tree"] or {}).items():  # KV moves are made on the host (move_kv): none here
            values.append(ort.OrtValue.ortvalue_from_numpy(array))
            binding.bind_ortvalue_input(name, values[-1])
        plan = None
        names = plan_names({value.name for value in session.get_inputs()})
        if names:
            rows, seq = arrays["input_ids"].shape
            plan = CallPlan(rows, seq, arrays["logits"].shape[1], names, lanes=self.lanes or 1)
            for name, array in plan.arrays.items():
                values.append(ort.OrtValue.ortvalue_from_numpy(array))
                binding.bind_ortvalue_input(name, values[-1])
        for name, value in zip(self.kv_names, self.kv):
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(contract.retained(name), value)
        return OrtBinding(spec, **arrays, session=session, binding=binding, keep=values, plan=plan)

    def mixed_for(self, k: int, width: int, end: int) -> OrtBinding:
        if not self.mixes_prefill:
            return super().mixed_for(k, width, end)
        spec = self.decode_for(k, end).spec.model_copy(update={"seq_len": width})
        if spec not in self._mixed:  # made on first use, a few per package (K x chunk widths)
            self._mixed[spec] = self._bind(spec, self.bindings[self.prefill_spec].session)
        return self._mixed[spec]

    def written_slots(self, positions: list[int]) -> list[int]:
        if self.lanes is None:
            return super().written_slots(positions)
        return op_slots(positions, self.lanes)

    def move_kv(self, slot: int, moves: list[tuple[int, int]]) -> None:
        if not self.verifies_trees:
            super().move_kv(slot, moves)
        sources, targets = [a for a, _ in moves], [b for _, b in moves]
        for array in self.kv_arrays:  # [rows, kv_heads, kv_len, width]
            array[slot, :, targets] = array[slot, :, sources]

    def run(self, bound: OrtBinding) -> np.ndarray:
        """One call with the inputs written into ``bound``'s arrays; returns its logits array."""
        if bound.plan is not None:
            bound.plan.write(bound.position_ids)
        if bound.tree is not None:
            write_tree_inputs(bound.position_ids, bound.tree)
        bound.session.run_with_iobinding(bound.binding)
        return bound.logits
