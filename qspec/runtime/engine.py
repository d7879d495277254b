"""Speculative decoding on a compiled package: prefill, then [propose → pick K → verify → accept]*.

Terms, used the same way everywhere:

- **proposed**: draft tokens a proposer offers for a sequence in one step (``d_1..d_n``);
- **accepted**: the longest prefix of the drafts the target agrees with;
- **bonus**: the one token the target adds after the accepted drafts (always one per call);
- **position** of a sequence: how many of its tokens are in the KV cache; its ``last`` token (the
  newest one) is not yet, and is the first token of the next call.

One decode step for the live sequences of the batch::

    drafts = propose(seq)                     per sequence, cut to the context and token budget
    K      = pick_k(max(len(drafts)))         the smallest compiled K that covers every draft
    logits = verify(K, [last, d_1..d_n])      one call of the seq_len = K + 1 specialization
    accept(seq, logits)                       accepted drafts + bonus; positions advance; no KV copy

Rows with fewer drafts than K, and slots with no live sequence, are padded with PAD_POSITION:
the graph writes nothing a live token can see for them. Greedy output is token-for-token the
output of plain greedy decoding of the same model.

A request admitted while others decode (several KV slots, a model that takes wider calls: the ort
backend's runtime graph) is prefilled a ``prefill_seq_len`` chunk per decode step, in the same call
as the decoding rows (``verify(..., chunks)``): the running requests do not stop for its prompt.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from qspec.errors import ConfigError
from qspec.package import TOKENIZER_DIR
from qspec.runtime.config import EngineConfig
from qspec.runtime.dispatch import Dispatcher, check_mode, restrict_ks
from qspec.runtime.layout import VerifyLayout
from qspec.runtime.load import load_model
from qspec.runtime.metrics import EngineMetrics, aggregate
from qspec.runtime.prefill import PrefillRow, place_rows, run_prefill
from qspec.runtime.prefix import PrefixCache
from qspec.runtime.proposal import Proposal, Proposer
from qspec.runtime.proposers import HEAD_METHODS, METHOD_ALIASES, make_proposer
from qspec.runtime.request import (
    Prompt,
    RequestOutput,
    SequenceState,
    TextCallback,
    as_prompt_list,
    check_fits,
    params_per_prompt,
)
from qspec.runtime.sampling import (
    SamplingParams,
    accept_sampled,
    process_logits,
    sample_tokens,
)
from qspec.runtime.scheduler import Scheduler
from qspec.runtime.session import LoadedModel
from qspec.runtime.tokenizer import Tokenizer

OutputCallback = Callable[[RequestOutput], None]


class Engine(Scheduler):
    """Generate with speculative decoding from a compiled package, on any runtime backend.

    >>> engine = Engine("packages/SmolLM2-135M-Instruct.Q4_1-k0_4", method="pld")
    >>> out = engine.generate(["def add(a, b):"], SamplingParams(max_new_tokens=32))
    >>> out[0].text, engine.last_metrics.output_tokens_per_s
    """

    def __init__(
        self,
        package: str | Path,
        config: EngineConfig | None = None,
        *,
        proposer: Proposer | None = None,
        model: LoadedModel | None = None,
        **knobs: Any,
    ):
        """Load ``package`` and run it as ``config`` says (:class:`~qspec.runtime.config.EngineConfig`; or its
        fields as keywords, ``Engine(package, method="pld")``, any other keyword a knob of the proposer).

        ``proposer``: a proposer of your own instead of the method's; ``model``: a loaded package to share
        (engines on one model share its weights, sessions and KV cache, one at a time). ``config.backend`` is
        where the package runs, ``ort`` (ONNX Runtime, CPU) or ``qaic`` (its QPC on Cloud AI 100); the engine is
        the same on both. ``prefix_cache``: a request whose prompt starts with what an idle KV slot holds takes
        that slot and prefills only the rest (:mod:`qspec.runtime.prefix`); off for methods that read the
        prompt's hidden states, which a reused prefix does not produce again. ``config.max_batch_size`` caps the
        sequences in flight (default: the package's decode rows); KV slots beyond them (``--kv-cache-batch-size``)
        keep prefixes.
        """
        if config is not None and knobs:
            raise ConfigError(f"give an EngineConfig or its fields, not both ({', '.join(sorted(knobs))})")
        self.config = config = config or EngineConfig.of(**knobs)
        self.model = model or load_model(
            package,
            backend=config.backend,
            session_mode=config.session_mode,
            spinning=config.spinning,
            num_threads=config.num_threads,
        )
        self.tokenizer = Tokenizer(self.model.package / TOKENIZER_DIR)
        self.method = method = METHOD_ALIASES.get(config.method, config.method)  # ngram is pld, eagle3 eagle
        self.proposer: Proposer = proposer or self._make_proposer(method, config)
        if self.proposer.wants_hidden_states and not self.model.manifest.model.hidden_states:
            raise ConfigError(f"method {method} reads hidden states: {package} has none; compile it with --draft-head")
        self.ks = restrict_ks(self.model.ks, config.num_speculative_tokens)
        self.k_max = self.ks[-1] if method != "none" else 0
        self.num_slots = self._slots_for(config.max_batch_size)  # sequences in flight
        self.kv_slots = self.model.rows  # the slots beyond num_slots keep finished requests' prefixes
        target = self.model
        self.proposer.check_target(vocab_size=target.vocab_size, ctx_len=target.ctx_len, num_slots=self.num_slots)
        if config.force_accept is not None and config.force_accept < 0:
            raise ConfigError(f"force_accept {config.force_accept} must be >= 0")
        self.force_accept = config.force_accept
        self.eos_token_ids = self.tokenizer.stop_ids(self.model.manifest.model.eos_token_ids)
        check_mode(config.dispatch)
        self.last_metrics: EngineMetrics | None = None
        self.calls: dict[str, int] = dict.fromkeys(["prefill", *map(str, self.ks)], 0)  # since load
        self.seconds = dict.fromkeys(("prefill", "decode", "propose"), 0.0)  # since load (EngineMetrics.seconds)
        self._waiting: deque[SequenceState] = deque()
        self._slots: list[SequenceState | None] = [None] * self.kv_slots
        # Admitted while other rows decode: their prompts go a chunk per decode call (mixed calls).
        self._prefilling: list[SequenceState] = []
        self.mixed_calls = 0  # decode calls since load that also carried prompt chunks (counted under their K too)
        self._updated: dict[int, SequenceState] = {}  # requests with news for the next delta
        self.prefix = PrefixCache(self.kv_slots, enabled=config.prefix_cache and not self.proposer.wants_hidden_states)
        self._next_id = 0
        self.dispatcher = self.warmup(config.dispatch)
        self.proposer.limit_depth(self.dispatcher.useful_depth)

    def _make_proposer(self, method: str, config: EngineConfig) -> Proposer:
        """The method's proposer from the config's knobs; a head method's head lives in the target's package."""
        knobs = config.proposer_knobs()
        if method in HEAD_METHODS:
            knobs = {"package": self.model.package} | knobs
        return make_proposer(method, **knobs)

    def _slots_for(self, max_batch_size: int | None) -> int:
        """Sequences in flight: ``max_batch_size``, at most the package's decode rows (default: all of them)."""
        slots = self.model.decode_rows
        if max_batch_size is not None and not 1 <= max_batch_size <= slots:
            raise ConfigError(f"max_batch_size {max_batch_size} must be in [1, {slots}] (the decode rows)")
        return max_batch_size or slots

    def warmup(self, dispatch: str) -> Dispatcher:
        """Run every specialization on padding (the first request pays no set-up); returns the dispatcher,
        its call prices measured when ``dispatch`` may use them."""
        self.model.warm_up()
        return Dispatcher.for_model(self.model, self.ks, mode=dispatch, k_max=self.k_max, num_slots=self.num_slots)

    # ------------------------------------------------------------------ phases

    def prefill(self, group: list[SequenceState]) -> None:
        """Run the prompts of ``group`` (from what a mixed call already wrote) in chunks of
        ``prefill_seq_len``; sets each one's first token."""
        rows = [PrefillRow(seq.slot, seq.prompt[seq.prefilled :], start=seq.prefilled) for seq in group]
        on_hidden = None
        if self.proposer.wants_hidden_states:
            on_hidden = lambda i, start, hidden: self.proposer.observe_hidden(group[i].index, start, hidden)  # noqa: E731
        first = lambda i, logits: self._first_token(group[i], logits)  # noqa: E731
        begin = time.perf_counter()
        self.calls["prefill"] += run_prefill(self.model, rows, first, on_hidden)
        self.seconds["prefill"] += time.perf_counter() - begin

    def _first_token(self, seq: SequenceState, logits: np.ndarray) -> None:
        """The prompt is in the cache: sample the first token from ``logits`` [1, vocab] after it."""
        seq.prefilled = seq.position = len(seq.prompt)
        first = sample_tokens(logits, seq.params, seq.rng)[0]
        seq.metrics.first_token(time.perf_counter())
        self._emit(seq, [first], logits)

    def next_chunks(self) -> list[tuple[SequenceState, int, list[int]]]:
        """``(seq, start, tokens)``: the next ``prefill_seq_len`` prompt tokens of every prefilling request."""
        width = self.model.prefill.spec.seq_len
        return [(seq, seq.prefilled, seq.prompt[seq.prefilled : seq.prefilled + width]) for seq in self._prefilling]

    def draft_cap(self, seq: SequenceState) -> int:
        """Most drafts ``seq`` may verify: no position may reach ``ctx_len``, no token past the budget."""
        return max(0, min(self.k_max, self.model.ctx_len - 1 - seq.position, seq.remaining - 1))

    def propose(self, live: list[SequenceState]) -> list[Proposal]:
        """A proposal for every live sequence, each cut to its :meth:`draft_cap`; none for a sequence whose
        drafting does not pay (:meth:`Dispatcher.drafting`)."""
        drafting = self.dispatcher.drafting([seq.index for seq in live], greedy=all(s.params.greedy for s in live))
        caps = [self.draft_cap(seq) if on else 0 for seq, on in zip(live, drafting)]
        begin = time.perf_counter()
        proposals = self.proposer.propose_batch([(seq.index, cap) for seq, cap in zip(live, caps)])
        took = time.perf_counter() - begin
        self.seconds["propose"] += took
        self.dispatcher.observe_drafting(took * 1000, sum(cap > 0 for cap in caps))
        return [self._verifiable(seq, proposal).cut(cap) for seq, proposal, cap in zip(live, proposals, caps)]

    def _verifiable(self, seq: SequenceState, proposal: Proposal) -> Proposal:
        """``proposal`` as this row can verify it: a tree's top-1 chain unless the row is greedy, no drafts are
        forced and the model verifies trees (:attr:`LoadedModel.verifies_trees`)."""
        if seq.params.greedy and self.force_accept is None and self.model.verifies_trees:
            return proposal
        return proposal.chain_only()

    def verify(
        self,
        k: int,
        batch: list[tuple[SequenceState, VerifyLayout]],
        chunks: Sequence[tuple[SequenceState, int, list[int]]] = (),
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One call of the ``seq_len = k + 1`` specialization; logits ``[rows, k + 1, vocab]`` and, on a package
        with the ``hidden_states`` output, the hidden states ``[rows, seq_len, hidden]`` (left-aligned). With
        ``chunks`` (``(seq, start, tokens)`` of prompts being prefilled) the call is that shape made as wide
        as a prefill chunk (:meth:`LoadedModel.mixed_for`); a chunk's last logits are ``[seq.row, -1]``. Each
        sequence's call row is ``seq.row`` (:func:`~qspec.runtime.prefill.place_rows`: its KV slot, or with more
        KV slots than rows the next row, ``batch_index`` pointing at the slot). A row is ``[last, drafts...]`` at
        its layout's positions (a tree's siblings share one, :class:`~qspec.runtime.layout.VerifyLayout`)."""
        end = max([seq.position + len(layout) + 1 for seq, layout in batch] + [s + len(t) for _, s, t in chunks])
        if chunks:
            bound = self.model.mixed_for(k, max(k + 1, self.model.prefill.spec.seq_len), end)
        else:
            bound = self.model.decode_for(k, end)
        bound.reset()
        rows = place_rows(self.model, bound, [seq.slot for seq, _ in batch] + [seq.slot for seq, _, _ in chunks])
        for (seq, layout), row in zip(batch, rows):
            n, seq.row = len(layout), row
            bound.input_ids[row, 0] = seq.last
            bound.input_ids[row, 1 : n + 1] = layout.tokens
            bound.position_ids[row, : n + 1] = layout.positions(seq.position)
        for (seq, start, tokens), row in zip(chunks, rows[len(batch) :]):
            seq.row = row
            bound.input_ids[row, : len(tokens)] = tokens
            bound.position_ids[row, : len(tokens)] = np.arange(start, start + len(tokens))
        self.calls[str(k)] += 1
        self.mixed_calls += bool(chunks)
        begin = time.perf_counter()
        logits = self.model.run(bound)
        took = time.perf_counter() - begin
        self.seconds["decode"] += took
        if not chunks:  # a chunk's tokens are not K's price
            live = sum(len(layout) + 1 for _, layout in batch)
            self.dispatcher.observe_call(k, took * 1000, live)
        return logits, bound.hidden_states

    def accept(self, seq: SequenceState, proposal: Proposal, logits: np.ndarray) -> tuple[list[int], list[int]]:
        """``(path, tokens)`` from this row's ``[n + 1, vocab]`` logits: the accepted drafts' indices (a greedy row
        walks its tree, :meth:`VerifyLayout.walk_greedy`; others are chains) and the emitted tokens, the accepted
        drafts plus the bonus."""
        layout = proposal.layout
        if self.force_accept is not None:
            path = list(range(min(len(layout), self.force_accept)))
            bonus = sample_tokens(logits[len(path) : len(path) + 1], seq.params, seq.rng)[0]
        elif seq.params.greedy:
            path, bonus = layout.walk_greedy(logits.argmax(axis=-1))
        else:
            probs = process_logits(logits, seq.params)
            accepted, bonus = accept_sampled(probs, proposal.tokens, seq.rng, proposal.probs)
            path = list(range(accepted))
        return path, [*layout.tokens[path].tolist(), int(bonus)]

    def decode(self, live: list[SequenceState]) -> None:
        """One decode step for every live sequence: propose, pick K, verify, accept."""
        proposals = self.propose(live)
        k, depths = self.dispatcher.plan(proposals, greedy=all(seq.params.greedy for seq in live))
        batch = [(seq, p.cut(depth)) for seq, p, depth in zip(live, proposals, depths)]
        chunks = self.next_chunks()
        logits, hidden = self.verify(k, [(seq, p.layout) for seq, p in batch], chunks)  # [rows, k + 1, vocab]
        hidden = hidden if self.proposer.wants_hidden_states else None
        for seq, start, tokens in chunks:
            if hidden is not None:
                self.proposer.observe_hidden(seq.index, start, hidden[seq.row, : len(tokens)])
            seq.prefilled = start + len(tokens)
            if seq.prefill_done:  # it decodes from the next step
                self._prefilling.remove(seq)
                self._first_token(seq, logits[seq.row, -1:])
        for seq, proposal in batch:
            n = len(proposal)
            row = logits[seq.row, k - n : k + 1]  # right-aligned: the last n + 1 real tokens
            path, tokens = self.accept(seq, proposal, row)
            layout = proposal.layout
            moves = []  # an accepted draft off the chain: its KV to the slot of its depth
            if proposal.parents is not None and path:
                moves = layout.moves(path, self.model.written_slots(layout.positions(seq.position).tolist()))
            if moves:
                self.model.move_kv(seq.slot, [(seq.position + a, seq.position + b) for a, b in moves])
            seq.metrics.target_call(k, proposed=n, accepted=len(path))
            self.dispatcher.observe_row(seq.index, proposal, path)
            rows = layout.rows(path)  # `last` and the accepted drafts: each precedes an emitted token
            if hidden is not None:
                self.proposer.observe_hidden(seq.index, seq.position, hidden[seq.row, rows])
            seq.position += len(tokens)  # `last` and the accepted drafts are now in the cache
            self._emit(seq, tokens, row[rows])

    # ------------------------------------------------------------------ bookkeeping

    def _emit(self, seq: SequenceState, tokens: list[int], logits: np.ndarray | None = None) -> None:
        """Append ``tokens`` (picked from ``logits`` rows) to ``seq`` until a stop; the proposer learns the
        tokens of a sequence that goes on."""
        kept = seq.append(tokens, self.eos_token_ids, self.model.ctx_len, logits)
        self._updated[seq.index] = seq
        if seq.finish_reason is None:
            self.proposer.extend(seq.index, kept)

    # ------------------------------------------------------------------ orchestration

    def generate(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        on_text: TextCallback | None = None,
        on_output: OutputCallback | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, up to ``num_slots`` in flight (continuous batching).

        ``prompts``: a string, a list of token ids, chat messages, or a list of those.
        ``params``: one :class:`SamplingParams` for all, or one per prompt (default: greedy, 128 tokens).
        ``on_text(index, text)`` receives each request's text as it is generated, ``on_output(output)`` each
        request's output as it finishes (``output.index``: its prompt's).
        Metrics of the call are in :attr:`last_metrics`. A thin loop over :meth:`add_request` and
        :meth:`step`; the engine must have no request of its own in flight.
        """
        prompts = as_prompt_list(prompts)
        params = params_per_prompt(params, len(prompts))
        if self.has_unfinished():
            raise ConfigError("generate() needs an idle engine: requests added with add_request() are still in flight")
        encoded = [self.tokenizer.encode_prompt(p, chat=chat) for p in prompts]
        for i, (ids, p) in enumerate(zip(encoded, params)):
            check_fits(f"prompt {i}", ids, self.model.ctx_len, new_tokens=p.max_new_tokens)
        calls_before, seconds_before = dict(self.calls), dict(self.seconds)
        start = time.perf_counter()
        order = {self.add_request(ids, p, arrival=start): i for i, (ids, p) in enumerate(zip(encoded, params))}
        outputs: list[RequestOutput | None] = [None] * len(order)
        try:
            while self.has_unfinished():
                for delta in self.step():
                    index = order[delta.request_id]
                    if delta.text and on_text is not None:
                        on_text(index, delta.text)
                    if delta.output is not None:
                        outputs[index] = replace(delta.output, index=index)
                        if on_output is not None:
                            on_output(outputs[index])
        finally:
            for request_id in order:
                self.abort(request_id)
            self._drain()
        wall = time.perf_counter() - start
        calls = {k: n - calls_before[k] for k, n in self.calls.items()}
        seconds = {part: s - seconds_before[part] for part, s in self.seconds.items()}
        self.last_metrics = aggregate([o.metrics for o in outputs], wall, calls, seconds)
        return outputs
