"""The engine thread: the one owner of the engine, driving its scheduler between HTTP requests.

HTTP handlers never touch the engine. They hand a :class:`Ticket` to :meth:`EngineWorker.submit` and
read the request's deltas from the ticket's asyncio queue; the thread puts them there with
``loop.call_soon_threadsafe``. Between two engine steps the thread takes every command waiting in its
inbox (add a request, abort one, stop), so a request joins the running batch at the next step and a
cancelled one leaves it there. With nothing to do the thread sleeps on the inbox.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from qspec.runtime.engine import Engine
from qspec.runtime.request import RequestDelta
from qspec.runtime.sampling import SamplingParams
from qspec.serve.errors import ServeError, queue_full, shutting_down
from qspec.serve.metrics import ServeMetrics

log = logging.getLogger("qspec.serve")


@dataclass
class Ticket:
    """One HTTP request's line to the engine thread: what to generate, where its deltas go."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestDelta, or an exception to raise
    arrival: float = field(default_factory=time.perf_counter)
    request_id: int | None = None  # the engine's, once added
    last_token_time: float | None = None

    def deliver(self, item: RequestDelta | Exception) -> None:
        try:
            self.loop.call_soon_threadsafe(self.deltas.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is listening
            pass


class EngineWorker:
    """Runs ``engine`` in one thread; at most ``num_slots + max_waiting`` requests in the system."""

    def __init__(self, engine: Engine, metrics: ServeMetrics, *, max_waiting: int):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tickets: dict[int, Ticket] = {}  # engine request id -> ticket, until its last delta
        self._in_system = 0  # submitted and not finished
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="qspec-engine", daemon=True)
        self._stopping = False

    # ------------------------------------------------------------------ HTTP side (any thread)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket`` for the engine; ServeError 429 when the waiting queue is full, 503 when stopping."""
        with self._lock:
            if self._stopping:
                raise shutting_down()
            if self._in_system >= self.engine.num_slots + self.max_waiting:
                raise queue_full(self._in_system - self.engine.num_slots)
            self._in_system += 1
        self._inbox.put(("add", ticket))

    def cancel(self, ticket: Ticket) -> None:
        """Abort ``ticket``'s request at the next step (a client went away)."""
        self._inbox.put(("abort", ticket))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is still in flight and end the thread."""
        with self._lock:
            self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while True:
            if not self._take_commands(block=not self._tickets):
                break
            if self._tickets:
                self._step()
        self._cancel_all(shutting_down())

    def _take_commands(self, *, block: bool) -> bool:
        """Apply every waiting command (waiting for one if ``block``); False once told to stop."""
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, ticket = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(ticket)
            elif kind == "abort" and ticket.request_id is not None:
                self.engine.abort(ticket.request_id)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, ticket: Ticket) -> None:
        try:
            ticket.request_id = self.engine.add_request(ticket.prompt_ids, ticket.params, arrival=ticket.arrival)
        except Exception as exc:  # a prompt the handler let through (it checks the same rule first)
            self._forget(ticket)
            ticket.deliver(exc)
            return
        self._tickets[ticket.request_id] = ticket

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as exc:  # the engine failed: fail what is in flight, keep serving
            log.exception("engine step failed")
            self._cancel_all(
                ServeError(f"engine step failed: {type(exc).__name__}: {exc}", status=500, code="engine_error")
            )
            return
        now = time.perf_counter()
        for delta in deltas:
            self._dispatch(delta, now)
        self.metrics.engine_calls(self.engine.calls, self.engine.mixed_calls)
        self.metrics.prefix_cache(self.engine.prefix.queries, self.engine.prefix.hits)
        self.metrics.queue(running=self.engine.num_running, waiting=self.engine.num_waiting)

    def _dispatch(self, delta: RequestDelta, now: float) -> None:
        ticket = self._tickets.get(delta.request_id)
        if ticket is None:
            return
        if delta.token_ids:
            first = ticket.last_token_time is None
            since = now - (ticket.arrival if first else ticket.last_token_time)
            self.metrics.tokens(delta, first=first, prompt_tokens=len(ticket.prompt_ids), since_last_s=since)
            ticket.last_token_time = now
        if delta.finished:
            self.metrics.finished(delta.finish_reason, now - ticket.arrival)
            del self._tickets[delta.request_id]
            self._forget(ticket)
        ticket.deliver(delta)

    def _forget(self, ticket: Ticket) -> None:
        with self._lock:
            self._in_system -= 1

    def _cancel_all(self, error: Exception) -> None:
        for request_id, ticket in list(self._tickets.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is in an unknown state; the ticket still gets its answer
                log.exception("abort failed")
            self._forget(ticket)
            self.metrics.finished("abort", 0.0)
            ticket.deliver(error)
        self._tickets.clear()
        try:
            self.engine.step()  # nothing is left to run: this only collects the aborted requests' last deltas
        except Exception:
            log.exception("clean-up step failed")
        self.metrics.queue(running=self.engine.num_running, waiting=self.engine.num_waiting)
