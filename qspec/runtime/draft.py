"""Draft-model proposer (method ``draft``): a small compiled package of the same vocabulary drafts.

The draft package is compiled like any other (``num_speculative_tokens=0``: a prefill shape and a
``seq_len = 1`` decode shape; typically ``num_layers=N`` keeps the target's first N layers) and is
loaded as the target is (:func:`~qspec.runtime.load.load_model`), with its own KV cache. Each step drafts up to
``cap`` tokens for every request, one token per call, batched over the requests in **one** ``seq_len = 1`` call
per draft step; a row that needs fewer tokens is padded (``PAD_POSITION``).

KV consistency. Per request the proposer keeps the target's history (``tokens``: prompt and every
emitted token) and ``cached``: the tokens whose KV sits at positions ``0, 1, ...`` of the draft cache.
Writes are position-based, so KV past ``len(cached)`` is stale and never attended before it is
overwritten: a rejection costs nothing. Worked example, history ``[p0 .. p4]`` (``p4`` is the
target's newest token, not in the draft cache yet), ``cap = 3``::

    call 1 feeds p4 @4 -> d1     call 2 feeds d1 @5 -> d2     call 3 feeds d2 @6 -> d3
    cached = [p0 .. p4, d1, d2]                                (d3 was never fed)

- target accepts d1, rejects d2 and adds the bonus ``b``: history ``[p0 .. p4, d1, b]``; the cache
  holds the common prefix ``[p0 .. p4, d1]``: one token (``b``) is pending.
- target accepts all three, bonus ``b``: history ``[p0 .. p4, d1, d2, d3, b]``; the cache holds
  ``[p0 .. p4, d1, d2]``: two tokens (``d3, b``) are pending, the draft catches up first.

Pending tokens are fed before drafting: a short backlog through the batched ``seq_len = 1`` calls
(a row just starts drafting a call or two later), a long one (the prompt) through the prefill
shape in chunks. The logits after the last pending token give the first draft.

Sampling (a request started with ``temperature > 0``): each draft is drawn from the draft's own
processed distribution ``q`` (:func:`process_logits` with the request's parameters), and the
:class:`Proposal` carries ``q`` to the engine's ``min(1, p / q)`` rule. Greedy drafts are the
argmax and the proposal has no ``probs``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qspec.errors import ConfigError
from qspec.runtime.load import load_model
from qspec.runtime.prefill import PrefillRow, run_prefill
from qspec.runtime.proposal import Proposal, Proposer, RequestId, Tokens, as_tokens, unknown_request
from qspec.runtime.sampling import SamplingParams, make_rng, process_logits, sample_token
from qspec.runtime.session import Binding, SessionMode

GREEDY = SamplingParams()
# A backlog of at least this many tokens is fed with the prefill shape; shorter ones ride along in
# the batched seq_len = 1 calls: a prefill call costs a few seq_len = 1 calls, and a short backlog
# shares its calls with the other rows of the batch (docs/measurements.md).
DEFAULT_PREFILL_MIN_TOKENS = 3

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def cached_prefix(cached: Sequence[int], tokens: Sequence[int], start: int = 0) -> int:
    """How many of ``cached`` the draft cache still holds correctly for history ``tokens``.

    The common prefix of both (the first ``start`` are known to agree), but at most
    ``len(tokens) - 1``: the newest token is always fed again, its logits give the next draft.
    With the module docstring's example, ``cached = [p0..p4, d1, d2]``: history
    ``[p0..p4, d1, b]`` -> 6, ``[p0..p4, d1, d2, d3, b]`` -> 7.
    """
    n = min(len(cached), len(tokens) - 1)
    for i in range(min(start, n), n):
        if cached[i] != tokens[i]:
            return i
    return max(n, 0)


def softmax_max(logits: np.ndarray) -> float:
    """Largest probability of ``softmax(logits)`` (the draft's confidence in its argmax)."""
    x = logits.astype(np.float64)
    return float(1.0 / np.exp(x - x.max()).sum())


@dataclass
class _Request:
    """A request the draft follows."""

    slot: int
    tokens: list[int]  # the target's history: prompt and every emitted token
    cached: list[int] = field(default_factory=list)  # tokens whose KV is at positions 0.. of the draft cache
    params: SamplingParams = GREEDY
    rng: np.random.Generator | None = None

    @property
    def pending(self) -> list[int]:
        return self.tokens[len(self.cached) :]


@dataclass
class _Row:
    """One request's part of a proposal: tokens still to feed and the drafts drawn so far."""

    request: _Request
    cap: int
    feed: deque[int] = field(default_factory=deque)  # tokens to write into the draft cache, in order
    drafts: list[int] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)  # q of each draft, when sampling
    done: bool = False

    def proposal(self) -> Proposal:
        if not self.drafts:
            return Proposal.empty()
        probs = np.stack(self.probs) if self.probs else None
        return Proposal(np.asarray(self.drafts, dtype=np.int64), probs)


# --------------------------------------------------------------------------------------------
# Proposer
# --------------------------------------------------------------------------------------------


class DraftProposer(Proposer):
    """Drafts with a compiled draft package; the engine's ``draft`` method.

    >>> engine = Engine("packages/target-k0_4", method="draft", draft_package="packages/draft-l8-k0")
    """

    def __init__(
        self,
        draft_package: str | Path,
        *,
        target_vocab_size: int | None = None,
        target_ctx_len: int | None = None,
        num_slots: int | None = None,
        num_draft_tokens: int | None = None,
        draft_confidence_threshold: float = 0.0,
        prefill_min_tokens: int = DEFAULT_PREFILL_MIN_TOKENS,
        session_mode: SessionMode = "shared",
        spinning: bool = False,
        num_threads: int | None = None,
    ):
        """Load ``draft_package`` (compiled with ``num_speculative_tokens`` containing 0).

        ``target_vocab_size``, ``target_ctx_len``, ``num_slots``: the target's vocabulary, context
        and sequences in flight, checked against the draft package when given (see
        :meth:`check_target`). ``num_draft_tokens`` caps the drafts of a step (default: what the
        engine asks). ``draft_confidence_threshold`` (0 = off): a draft whose top probability is
        below it is dropped and ends the request's drafting for the step. ``prefill_min_tokens``:
        a backlog this long is fed with the prefill shape. ``num_threads``: threads of the draft
        session's own pool (default: every core); with ``spinning`` off (the default) an idle draft
        never steals the target's cores.
        """
        if num_draft_tokens is not None and num_draft_tokens < 0:
            raise ConfigError(f"num_draft_tokens {num_draft_tokens} must be >= 0")
        if not 0.0 <= draft_confidence_threshold <= 1.0:
            raise ConfigError(f"draft_confidence_threshold {draft_confidence_threshold} must be in [0, 1]")
        if prefill_min_tokens < 1:
            raise ConfigError(f"prefill_min_tokens {prefill_min_tokens} must be >= 1")
        self.model = load_model(  # the draft package runs on ONNX Runtime, whatever the target's backend
            draft_package, session_mode=session_mode, spinning=spinning, num_threads=num_threads
        )
        if 0 not in self.model.decode:
            raise ConfigError(
                f"draft package {self.model.package} has decode Ks {self.model.ks} but the draft runs "
                "seq_len=1 calls; recompile it with --num-speculative-tokens 0"
            )
        if self.model.decode_rows != self.model.rows:  # its calls run a row per slot
            raise ConfigError(
                f"draft package {self.model.package} has more KV slots than decode rows; recompile the draft "
                "without --kv-cache-batch-size"
            )
        self.decode: Binding = self.model.decode[0]
        self.ctx_len = self.model.ctx_len
        self.num_draft_tokens = num_draft_tokens
        self.draft_confidence_threshold = draft_confidence_threshold
        self.prefill_min_tokens = prefill_min_tokens
        self._requests: dict[RequestId, _Request] = {}
        self._free = list(range(self.model.rows))
        self.calls = {"prefill": 0, "decode": 0}  # draft model calls, for benchmarks
        self.check_target(vocab_size=target_vocab_size, ctx_len=target_ctx_len, num_slots=num_slots)

    def check_target(
        self, *, vocab_size: int | None = None, ctx_len: int | None = None, num_slots: int | None = None
    ) -> None:
        """Raise ConfigError unless the draft package fits the target (``None``: not checked)."""
        draft = self.model.package
        if vocab_size is not None and vocab_size != self.model.vocab_size:
            raise ConfigError(
                f"draft package {draft} has vocabulary size {self.model.vocab_size} but the target has "
                f"{vocab_size}; a draft model must share the target's tokenizer: compile the draft "
                "from the same model (e.g. with --num-layers) or one of the same family"
            )
        if ctx_len is not None and ctx_len > self.ctx_len:
            raise ConfigError(
                f"draft package {draft} has ctx_len {self.ctx_len} < the target's ctx_len {ctx_len}; "
                f"recompile the draft with --ctx-len {ctx_len}"
            )
        if num_slots is not None and num_slots > self.model.rows:
            raise ConfigError(self._too_few_slots(num_slots))

    def _too_few_slots(self, needed: int, *, at_least: bool = False) -> str:
        runs = f"at least {needed}" if at_least else str(needed)
        fix = "the target's full_batch_size" if at_least else str(needed)
        return (
            f"draft package {self.model.package} has {self.model.rows} KV slot(s) but the engine runs "
            f"{runs} sequences at once; recompile the draft with --full-batch-size {fix} "
            f"(or run the engine with max_batch_size={self.model.rows})"
        )

    # ------------------------------------------------------------------ request lifecycle

    def start(
        self,
        request_id: RequestId,
        prompt_tokens: Tokens,
        params: SamplingParams | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        """Take a free draft KV slot for ``request_id``; its prompt is fed at the first proposal.

        Drafts are sampled with ``params`` and ``rng`` (greedy drafts when ``params`` is greedy or None).
        """
        if request_id in self._requests:
            self.finish(request_id)
        if not self._free:
            raise ConfigError(self._too_few_slots(len(self._requests) + 1, at_least=True))
        params = params or GREEDY
        if rng is None and not params.greedy:
            rng = make_rng(params.seed)
        tokens = as_tokens(prompt_tokens).tolist()
        self._requests[request_id] = _Request(self._free.pop(0), tokens, params=params, rng=rng)

    def extend(self, request_id: RequestId, new_tokens: Tokens) -> None:
        """Append the tokens a step emitted; the cache keeps what it holds of the new history."""
        request = self._request(request_id)
        known = len(request.tokens)  # the cache never holds a wrong token before the new ones
        request.tokens.extend(as_tokens(new_tokens).tolist())
        del request.cached[cached_prefix(request.cached, request.tokens, known) :]

    def finish(self, request_id: RequestId) -> None:
        """Free the request's draft slot (calling it twice is harmless)."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._free.append(request.slot)
            self._free.sort()

    def _request(self, request_id: RequestId) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise unknown_request(request_id) from None

    # ------------------------------------------------------------------ proposing

    def propose(self, request_id: RequestId, k: int) -> np.ndarray:
        """At most ``k`` drafts for one request."""
        return self.propose_batch([(request_id, k)])[0].tokens

    def propose_batch(self, items: Sequence[tuple[RequestId, int]]) -> list[Proposal]:
        """At most ``cap`` drafts for each ``(request_id, cap)``, drafting the whole batch together."""
        rows = [self._plan(self._request(rid), cap) for rid, cap in items]
        live = [row for row in rows if row.cap > 0]
        self.prefill([row for row in live if len(row.feed) >= self.prefill_min_tokens])
        self.draft([row for row in live if not row.done])
        return [row.proposal() for row in rows]

    def _plan(self, request: _Request, cap: int) -> _Row:
        """A row for ``request``; ``cap`` cut so that no fed position reaches the draft's ctx_len.

        Feeding ``pending`` then ``cap - 1`` drafts uses positions up to ``len(tokens) + cap - 2``.
        """
        if self.num_draft_tokens is not None:
            cap = min(cap, self.num_draft_tokens)
        cap = max(0, min(cap, self.ctx_len + 1 - len(request.tokens)))
        return _Row(request, cap, deque(request.pending) if cap > 0 else deque())

    def prefill(self, rows: list[_Row]) -> None:
        """Feed each row's backlog with the prefill shape, in chunks; the last logits give draft 1."""
        if not rows:
            return
        backlogs = []
        for row in rows:
            backlogs.append(PrefillRow(row.request.slot, list(row.feed), start=len(row.request.cached)))
            row.request.cached.extend(row.feed)
            row.feed.clear()
        self.calls["prefill"] += run_prefill(
            self.model, backlogs, lambda i, logits: self._add_draft(rows[i], logits[0])
        )

    def draft(self, rows: list[_Row]) -> None:
        """Batched seq_len = 1 calls until every row has its drafts: one token per row per call.

        A row feeds its pending tokens, then each draft but the last; the call after its last
        pending token yields its first draft. Rows with nothing left to feed are padding.
        """
        bound = self.decode
        while True:
            bound.reset()
            fed = []
            for row in rows:
                if row.feed:
                    token, slot, position = row.feed.popleft(), row.request.slot, len(row.request.cached)
                    bound.input_ids[slot, 0] = token
                    bound.position_ids[slot, 0] = position
                    row.request.cached.append(token)
                    fed.append(row)
            if not fed:
                return
            logits = self.model.run(bound)  # [slots, 1, vocab]
            self.calls["decode"] += 1
            for row in fed:
                if not row.feed:
                    self._add_draft(row, logits[row.request.slot, 0])

    def _add_draft(self, row: _Row, logits: np.ndarray) -> None:
        """Draw the next draft from ``logits`` [vocab]; queue it to be fed if more are wanted.

        Under ``draft_confidence_threshold`` a draft whose top probability is below it is not
        proposed and ends the row: a draft that is unsure from the first token proposes nothing,
        so the engine dispatches K = 0. (The top probability depends on ``q`` only, never on the
        token drawn, so sampling stays lossless.)
        """
        request = row.request
        threshold = self.draft_confidence_threshold
        if request.params.greedy:
            if threshold > 0 and softmax_max(logits) < threshold:
                row.done = True
                return
            token = int(logits.argmax())
        else:
            q = process_logits(logits[None], request.params)[0]  # [vocab] float64
            if q.max() < threshold:
                row.done = True
                return
            token = sample_token(q, request.rng)
            row.probs.append(q)
        row.drafts.append(token)
        if len(row.drafts) < row.cap:
            row.feed.append(token)
        else:
            row.done = True
