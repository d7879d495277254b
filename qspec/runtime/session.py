"""The runtime session seam: a compiled package loaded on some device, behind one small interface.

The engine, the draft proposer and the prefill routine use only :class:`LoadedModel`:

- **load** a package (:func:`qspec.runtime.load.load_model`): its specializations, KV cache resident;
- **bind** a specialization: :attr:`LoadedModel.prefill`, :attr:`LoadedModel.decode` ``[K]`` are
  :class:`Binding` s, host arrays of that specialization's shapes the caller writes in place;
- **run** a call: :meth:`LoadedModel.run` (binding) -> its logits; the KV cache stays where the
  backend keeps it (an ORT value bound to both the input and its ``_RetainedState`` output, or
  the device's retained state) and is never copied to the host.

Backends: ``ort`` (ONNX Runtime on the CPU, :class:`qspec.runtime.model.CompiledModel`) and ``qaic``
(a Cloud AI 100 QPC through the vendor's Python runtime, :class:`qspec.runtime.qaic_session.QaicModel`).
"""

from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from qspec import contract
from qspec.errors import PromptTooLongError
from qspec.package import ONNX_FILE, Manifest, check_package
from qspec.runtime.tree_inputs import tree_arrays
from qspec.specializations import Specialization, decode_specialization, prefill_specialization

SessionMode = Literal["shared", "static"]  # ort: one session for every specialization, or one each


@dataclass
class Binding:
    """One specialization's host arrays: the caller writes the inputs in place, the call fills ``logits``."""

    spec: Specialization
    input_ids: np.ndarray  # [batch_size, seq_len]
    position_ids: np.ndarray  # [batch_size, seq_len]
    batch_index: np.ndarray | None  # [batch_size, 1], continuous batching only
    logits: np.ndarray  # [batch_size, num_logits_to_keep, vocab]: each row's last real tokens, right-aligned
    comp_ctx_lengths: np.ndarray | None = None  # [comp_ctx_lengths]: only its length matters
    # [batch_size, seq_len, hidden]: every live position's final-norm hidden state, on a package compiled for
    # a draft head (``manifest.model.hidden_states``); padding entries are unspecified.
    hidden_states: np.ndarray | None = None
    # A vendor graph with tree inputs: {name: array} of write_slots, tree_mask and kv_moves, written before each call
    # from position_ids (qspec.runtime.tree_inputs).
    tree: dict[str, np.ndarray] | None = None

    def reset(self) -> None:
        """Every row padding: token 0 at PAD_POSITION."""
        self.input_ids.fill(0)
        self.position_ids.fill(contract.PAD_POSITION)

    def fill_live(self, tokens_per_row: int) -> None:
        """Every row's first ``tokens_per_row`` tokens live (token 0 at positions 0, 1, ...), the rest padding:
        a call that costs what a real one does on a graph that skips padding. It writes those slots."""
        self.reset()
        self.position_ids[:, :tokens_per_row] = np.arange(tokens_per_row)


def host_arrays(
    spec: Specialization, vocab_size: int, *, continuous_batching: bool, tree_inputs: bool = False
) -> dict[str, Any]:
    """Zeroed host arrays of ``spec``'s shapes, every row padding: the fields of a :class:`Binding`."""
    rows, seq = spec.batch_size, spec.seq_len
    return {
        "tree": tree_arrays(rows, seq) if tree_inputs else None,
        "input_ids": np.zeros((rows, seq), dtype=np.int64),
        "position_ids": np.full((rows, seq), contract.PAD_POSITION, dtype=np.int64),
        "batch_index": np.arange(rows, dtype=np.int64)[:, None] if continuous_batching else None,
        "logits": np.zeros((rows, spec.num_logits_to_keep or 1, vocab_size), dtype=np.float32),
        "comp_ctx_lengths": np.zeros(spec.comp_ctx_lengths, dtype=np.int64) if spec.comp_ctx_lengths else None,
    }


class LoadedModel(ABC):
    """A compiled package on a backend: its shapes, one :class:`Binding` per specialization, ``run``.

    The constructor of a backend reads the package (:meth:`_read_package`), loads the network,
    allocates the KV cache where it lives, and fills :attr:`bindings`, then calls :meth:`_index`.
    """

    package: Path
    manifest: Manifest
    bindings: dict[Specialization, Binding]
    prefill: Binding  # the prefill binding of the largest compute-context-length bucket
    decode: dict[int, Binding]  # K -> binding of the seq_len = K + 1 specialization (largest bucket)
    # prefill and each decode shape of a graph that pads: the faster of two timed calls, after warm_up
    call_ms: dict[Specialization, float]
    packs_live_tokens: bool = False  # the graph's MatMuls run on live tokens only: padding costs (almost) nothing
    # A decode call may also carry prompt chunks (:meth:`mixed_for`): one session takes any shape.
    mixes_prefill: bool = False
    # A verify row may be a tree (qspec.runtime.layout): the graph's attention reads each token's ancestors only
    # (from the positions; a vendor graph's tree inputs are written from them, qspec.runtime.tree_inputs) and
    # :meth:`move_kv` moves an accepted sibling's KV to the slot of its depth (qaic: by the row's next call).
    verifies_trees: bool = False

    def _read_package(self, package: str | Path, prefill_seq_len: int | None = None) -> None:
        """Shapes the runtime needs, from the manifest: Ks, ctx_len, KV rows, vocabulary.

        ``prefill_seq_len``: prefill shapes of that many tokens instead of the package's (a backend
        whose graph takes any ``seq_len``); validated as ``qspec compile --prefill-seq-len`` would.
        """
        self.package = Path(package)
        self.manifest = check_package(self.package)
        model = self.manifest.model
        specs = self.manifest.specializations
        config = self.manifest.config
        if prefill_seq_len is not None:
            config = type(config).create(**(config.model_dump() | {"prefill_seq_len": prefill_seq_len}))
        # Rebuilt from the config: equal to the package's shapes (a shape equal to an earlier one
        # was dropped there, and the earlier one serves both: prefill_seq_len 1 and K=0).
        self.prefill_buckets = config.buckets("prefill")
        self.decode_buckets = config.buckets("decode")
        self.prefill_specs = {c: prefill_specialization(config, c) for c in self.prefill_buckets}
        self.bucket_specs = {
            (k, c): decode_specialization(config, k, c)
            for c in self.decode_buckets
            for k in config.num_speculative_tokens
        }
        self.ks = list(config.num_speculative_tokens)
        # Every shape once (prefill_seq_len 1 and K=0 are one shape), prefill first.
        self.specs = list(dict.fromkeys([*self.prefill_specs.values(), *self.bucket_specs.values()]))
        self.prefill_spec = self.prefill_specs[self.prefill_buckets[-1]]
        self.decode_specs = {k: self.bucket_specs[(k, self.decode_buckets[-1])] for k in self.ks}
        self.ctx_len = self.prefill_spec.ctx_len
        self.rows = self.prefill_spec.full_batch_size or max(s.batch_size for s in specs)  # KV slots
        self.decode_rows = self.decode_specs[self.ks[-1]].batch_size  # sequences a decode call runs (<= rows)
        self.continuous_batching = model.continuous_batching
        self.speculative = model.speculative
        self.vocab_size = model.vocab_size

    def _index(self) -> None:
        """:attr:`prefill` and :attr:`decode` from :attr:`bindings`."""
        self.prefill = self.bindings[self.prefill_spec]
        self.decode = {k: self.bindings[spec] for k, spec in self.decode_specs.items()}
        self.call_ms = {}

    def prefill_for(self, end: int) -> Binding:
        """The prefill binding of the smallest bucket that holds positions ``< end``.

        Under qaic-compile's CCL rule the largest prefill bucket can be below ctx_len (qspec.ccl): a
        prompt reaching past it is refused rather than attended to in part.
        """
        top = self.prefill_buckets[-1]
        if top is not None and end > top:
            raise PromptTooLongError(
                f"a prompt reaching position {end} passes the largest prefill bucket {top} of this package "
                f"(comp_ctx_lengths_prefill); shorten the prompt or compile with a prefill bucket >= {end}"
            )
        return self.bindings[self.prefill_specs[_bucket(self.prefill_buckets, end)]]

    def decode_for(self, k: int, end: int) -> Binding:
        """The K binding of the smallest bucket that holds positions ``< end`` (every row's, after the call)."""
        return self.bindings[self.bucket_specs[(k, _bucket(self.decode_buckets, end))]]

    def mixed_for(self, k: int, width: int, end: int) -> Binding:
        """A binding of the K decode shape ``width`` tokens wide (``width >= K + 1``), for a call whose rows
        are decode rows and prompt chunks of up to ``width`` tokens: the decode rows' K + 1 logits and a
        chunk's last ones (``logits[row, -1]``). Only when :attr:`mixes_prefill`."""
        raise NotImplementedError(f"{type(self).__name__} runs the compiled shapes only")

    def warm_up(self) -> None:
        """Run every specialization once on padding only: the first request pays no set-up; then, on a
        graph that pads (not :attr:`packs_live_tokens`, whose prompt tails stay in the prefill shape),
        time two more calls of the prefill and each decode shape (:attr:`call_ms`, the faster one: for
        :func:`qspec.runtime.prefill.chunk_shape`).

        Padding rewrites values a slot already holds, so the cache is unchanged.
        """
        for bound in self.bindings.values():
            bound.reset()
            self.run(bound)
        if self.packs_live_tokens:
            return
        for bound in (self.prefill, *self.decode.values()):
            times = []
            for _ in range(2):
                begin = time.perf_counter()
                self.run(bound)
                times.append((time.perf_counter() - begin) * 1000)
            self.call_ms[bound.spec] = min(times)

    def written_slots(self, positions: list[int]) -> list[int]:
        """Where a verify row's tokens at ``positions`` (``[last, drafts...]``) are written, as offsets from the
        row's first slot: their own index (a tree graph places drafts off the chain further, see
        :func:`qspec.backends.ort_plan.op_slots`)."""
        return list(range(len(positions)))

    def move_kv(self, slot: int, moves: list[tuple[int, int]]) -> None:
        """Copy KV slot ``a`` of KV row ``slot`` to slot ``b`` for each ``(a, b)`` of ``moves`` (an accepted tree
        draft's rows to the positions of their depths; every ``a`` is read before any ``b`` is written)."""
        raise NotImplementedError(f"{type(self).__name__} does not verify trees")

    @abstractmethod
    def run(self, bound: Binding) -> np.ndarray:
        """One call with the inputs written into ``bound``'s arrays; returns its logits array."""

    def weight_bytes(self) -> int:
        """Bytes of the weights a one-token call streams (the memory-bandwidth floor's numerator): the runtime
        graph's :attr:`~qspec.package.RuntimeGraph.weight_bytes`, which counts a MoE operator's experts as the
        top-k of them a token reads (Mixtral, top-2 of 8: a quarter of the experts' bytes; a verify call of more
        tokens may read more of them, so its floor is a lower bound)."""
        if self.manifest.runtime_graph is not None:  # backend ort: its graph, embedding tables excluded
            return self.manifest.runtime_graph.weight_bytes
        return sum(p.stat().st_size for p in self.package.glob(ONNX_FILE + "*"))


def _bucket(buckets: list[int | None], end: int) -> int | None:
    """The smallest compute context length ``>= end``: ``_bucket([256, 1024], 256) == 256``, ``(.., 257) == 1024``.

    ``[None]`` (a graph without buckets) always gives ``None``; ``end`` never exceeds ctx_len, the last bucket.
    """
    i = bisect.bisect_left(buckets, end) if buckets[0] is not None else 0
    return buckets[min(i, len(buckets) - 1)]
