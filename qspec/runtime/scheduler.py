"""The scheduler half of the :class:`~qspec.runtime.engine.Engine`: requests in, deltas out.

A request waits in a queue (:meth:`Scheduler.add_request`), is admitted to a free KV slot and prefilled
(in prefill calls, or a chunk per decode call beside the decoding rows when the model mixes them), decodes
a step per :meth:`Scheduler.step` and leaves its slot when it finishes or is aborted (its prompt and output
stay there as a prefix, :mod:`qspec.runtime.prefix`). The engine runs the phases (``prefill``, ``decode``);
this class only decides who runs them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from qspec.runtime.prefix import PrefixCache
from qspec.runtime.proposal import Proposer
from qspec.runtime.request import RequestDelta, SequenceState, check_fits
from qspec.runtime.sampling import SamplingParams, make_rng
from qspec.runtime.session import LoadedModel
from qspec.runtime.tokenizer import TextStream, Tokenizer


class Scheduler:
    """Admission, stepping and retirement of requests over an engine's KV slots (the engine's phases:
    ``prefill(group)`` and ``decode(live)``)."""

    model: LoadedModel
    tokenizer: Tokenizer
    proposer: Proposer
    prefix: PrefixCache
    num_slots: int  # sequences in flight
    _waiting: deque[SequenceState]
    _slots: list[SequenceState | None]
    _prefilling: list[SequenceState]  # admitted while other rows decode: a prompt chunk per decode call
    _updated: dict[int, SequenceState]  # requests with news for the next delta
    _next_id: int

    def prefill(self, group: list[SequenceState]) -> None:
        raise NotImplementedError

    def decode(self, live: list[SequenceState]) -> None:
        raise NotImplementedError

    @property
    def num_running(self) -> int:
        """Requests holding a KV slot."""
        return sum(seq is not None for seq in self._slots)

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet admitted to a slot."""
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or self.num_running > 0

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *, arrival: float | None = None
    ) -> int:
        """Queue a request; it joins the batch at a later :meth:`step`. Returns its request id."""
        ids = [int(t) for t in prompt_ids]
        request_id = self._next_id
        check_fits(f"prompt of request {request_id}", ids, self.model.ctx_len)
        self._next_id += 1
        params = params or SamplingParams()
        seq = SequenceState(request_id, ids, params, stream=TextStream(self.tokenizer), rng=make_rng(params.seed))
        seq.metrics.arrival = time.perf_counter() if arrival is None else arrival
        self._waiting.append(seq)
        return request_id

    def abort(self, request_id: int) -> bool:
        """Drop a request now: it leaves the queue or frees its slot, its last delta comes with the next step;
        False when the request is unknown or already finished."""
        waiting = next((seq for seq in self._waiting if seq.index == request_id), None)
        if waiting is not None:
            self._waiting.remove(waiting)
            waiting.finish_reason = "abort"
            waiting.metrics.finish(time.perf_counter(), len(waiting.output))
            self._updated[request_id] = waiting
            return True
        for slot, seq in enumerate(self._slots):
            if seq is not None and seq.index == request_id:
                seq.finish_reason = "abort"
                self._release(slot, time.perf_counter())
                return True
        return False

    def step(self) -> list[RequestDelta]:
        """One scheduler iteration: admit and prefill waiting requests into free slots, one decode step
        for every live request, retire the finished. Returns what each request produced in it."""
        self._admit()
        live = [seq for seq in self._slots if seq is not None and seq.prefill_done]
        before = {seq.index: (seq.metrics.proposed, seq.metrics.accepted) for seq in live}
        if live:
            self.decode(live)
        self._retire()
        return self._drain(before)

    def _admit(self) -> None:
        """Move waiting requests into free slots and prefill them, ``batch_size`` per prefill call; while other
        requests decode, on a model that :attr:`~LoadedModel.mixes_prefill`, their prompts go a chunk per
        decode call instead (the decoding rows do not wait for a whole prompt: :meth:`decode`)."""
        per_call = self.model.prefill.spec.batch_size if self.model.continuous_batching else self.num_slots
        slots = self._slots
        decoding = any(seq is not None and seq.prefill_done for seq in slots)
        if self._prefilling and not decoding:  # nobody left to ride along with: finish them in prefill calls
            group, self._prefilling = self._prefilling, []
            self.prefill(group)
            self._retire()
            decoding = any(seq is not None for seq in slots)
        mix = self.model.mixes_prefill and decoding
        while self._waiting and self.num_running < self.num_slots:  # a KV slot is then free
            group = []
            while self._waiting and self.num_running < self.num_slots and len(group) < per_call:
                seq = self._waiting.popleft()
                seq.slot, seq.prefilled = self.prefix.take(seq.prompt, [s for s, x in enumerate(slots) if x is None])
                slots[seq.slot] = seq
                self.proposer.start(seq.index, seq.prompt, seq.params, seq.rng)
                group.append(seq)
            if mix:
                self._prefilling.extend(group)
                continue
            self.prefill(group)
            self._retire()

    def _retire(self) -> None:
        now = time.perf_counter()
        for slot, seq in enumerate(self._slots):
            if seq is not None and seq.finish_reason is not None:
                self._release(slot, now)

    def _release(self, slot: int, now: float) -> None:
        seq = self._slots[slot]
        if seq in self._prefilling:  # aborted before its prompt was in
            self._prefilling.remove(seq)
        seq.metrics.finish(now, len(seq.output))
        self.proposer.finish(seq.index)
        self.prefix.release(slot, seq.cached_tokens())  # an aborted request's too: what it wrote is exact
        self._slots[slot] = None
        self._updated[seq.index] = seq

    def _drain(self, before: dict[int, tuple[int, int]] | None = None) -> list[RequestDelta]:
        """The deltas of every request updated since the last drain (new tokens and text, speculation counts)."""
        deltas = [seq.take_delta(self.tokenizer, (before or {}).get(seq.index)) for seq in self._updated.values()]
        self._updated = {}
        return deltas
