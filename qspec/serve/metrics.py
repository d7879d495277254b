"""Prometheus metrics, named as vLLM names them (``vllm:`` becomes ``qspec:``), in the server's own registry.

From the speculative-decoding counters follow, as in vLLM's dashboards:
acceptance rate = ``num_accepted_tokens / num_draft_tokens``, mean acceptance length =
``1 + num_accepted_tokens / num_drafts``. ``qspec:decode_calls_total{k}`` counts the target calls of each
compiled K (qspec's own).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from qspec.runtime.request import RequestDelta

FINISH_REASONS = ("stop", "length", "abort")
# vLLM's buckets (seconds)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class ServeMetrics:
    """The server's metrics; the engine thread updates them, ``GET /metrics`` renders them."""

    def __init__(self, model_name: str, ks: Sequence[int]):
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.running = Gauge(
            "qspec:num_requests_running", "Requests in the running batch (holding a KV slot).", m, registry=r
        )
        self.waiting = Gauge("qspec:num_requests_waiting", "Requests waiting for a KV slot.", m, registry=r)
        self.success = Counter(
            "qspec:request_success", "Finished requests, by finish reason.", [*m, "finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("qspec:prompt_tokens", "Prefilled prompt tokens.", m, registry=r)
        self.generation_tokens = Counter("qspec:generation_tokens", "Generated tokens.", m, registry=r)
        self.ttft = Histogram(
            "qspec:time_to_first_token_seconds", "Arrival to first token.", m, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "qspec:inter_token_latency_seconds",
            "Time between two engine steps that gave a request tokens (one step may give several).",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "qspec:e2e_request_latency_seconds", "Arrival to the last token.", m, buckets=E2E_BUCKETS, registry=r
        )
        self.num_drafts = Counter(
            "qspec:spec_decode_num_drafts", "Verify calls of a request with drafts.", m, registry=r
        )
        self.num_draft_tokens = Counter("qspec:spec_decode_num_draft_tokens", "Draft tokens verified.", m, registry=r)
        self.num_accepted_tokens = Counter(
            "qspec:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, registry=r
        )
        self.accepted_per_pos = Counter(
            "qspec:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position.",
            [*m, "position"],
            registry=r,
        )
        self.decode_calls = Counter("qspec:decode_calls", "Target decode calls, by compiled K.", [*m, "k"], registry=r)
        self.prefill_calls = Counter("qspec:prefill_calls", "Target prefill calls.", m, registry=r)
        self.mixed_calls = Counter(
            "qspec:mixed_calls",
            "Target decode calls that also wrote a prompt chunk (a request admitted while others decoded).",
            m,
            registry=r,
        )
        # vLLM's names: prompt tokens looked up in the prefix cache, and those found there (not prefilled again)
        self.prefix_queries = Counter(
            "qspec:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m, registry=r
        )
        self.prefix_hits = Counter(
            "qspec:prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled again).", m, registry=r
        )
        self.name = model_name
        self._calls_seen: dict = {}
        self._prefix_seen = (0, 0)
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self.success.labels(model_name, reason)
        for pos in range(max(ks, default=0)):
            self.accepted_per_pos.labels(model_name, str(pos))
        for k in ks:
            self.decode_calls.labels(model_name, str(k))
        per_model = (
            self.running,
            self.waiting,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
        )
        per_model += (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.prefill_calls)
        per_model += (self.mixed_calls, self.prefix_queries, self.prefix_hits)
        for metric in per_model:
            metric.labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def queue(self, *, running: int, waiting: int) -> None:
        self.running.labels(self.name).set(running)
        self.waiting.labels(self.name).set(waiting)

    def tokens(self, delta: RequestDelta, *, first: bool, prompt_tokens: int, since_last_s: float) -> None:
        """A delta with new tokens: the first one counts the prompt and TTFT, later ones an inter-token latency."""
        if first:
            self.prompt_tokens.labels(self.name).inc(prompt_tokens)
            self.ttft.labels(self.name).observe(since_last_s)
        else:
            self.itl.labels(self.name).observe(since_last_s)
        self.generation_tokens.labels(self.name).inc(len(delta.token_ids))
        if delta.proposed:
            self.num_drafts.labels(self.name).inc()
            self.num_draft_tokens.labels(self.name).inc(delta.proposed)
            self.num_accepted_tokens.labels(self.name).inc(delta.accepted)
            for pos in range(delta.accepted):
                self.accepted_per_pos.labels(self.name, str(pos)).inc()

    def finished(self, reason: str, e2e_s: float) -> None:
        self.success.labels(self.name, reason).inc()
        if reason != "abort":
            self.e2e.labels(self.name).observe(e2e_s)

    def engine_calls(self, calls: dict, mixed: int = 0) -> None:
        """Move the call counters to the engine's running totals (``{"prefill": n, k: n, ...}``, and the
        decode calls among them that carried prompt chunks)."""
        totals = {**calls, "mixed": mixed}
        own = {"prefill": self.prefill_calls, "mixed": self.mixed_calls}  # every other key is a K
        for key, total in totals.items():
            new = total - self._calls_seen.get(key, 0)
            if new:
                counter = own[key].labels(self.name) if key in own else self.decode_calls.labels(self.name, str(key))
                counter.inc(new)
        self._calls_seen = totals

    def prefix_cache(self, queries: int, hits: int) -> None:
        """Move the prefix cache counters to the engine's running totals (tokens)."""
        seen_queries, seen_hits = self._prefix_seen
        self.prefix_queries.labels(self.name).inc(queries - seen_queries)
        self.prefix_hits.labels(self.name).inc(hits - seen_hits)
        self._prefix_seen = (queries, hits)
