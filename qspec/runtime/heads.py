"""Hidden-state proposers: drafts from a head that reads the target's own final-norm hidden states.

The engine hands such a proposer (``wants_hidden_states``) the hidden states of every position the
target computed for the request (:meth:`HiddenStateProposer.observe_hidden`: prompt chunks, then the
verified rows of each step up to the bonus) before it tells it the emitted tokens (``extend``).

**EAGLE** (one decoder layer with its own KV cache, at the target's positions). The pair (hidden
``f_t``, token ``x_{t+1}``) sits at head position ``t`` and predicts ``f_{t+1}``, whose LM-head
argmax is the draft ``x_{t+2}``. Example: prompt ``x_0..x_4``, first token ``x_5`` (position 5).
``propose`` first catches up the pairs not yet in the head's cache, ``t = 0..4`` (one call), whose
last row gives ``d_1`` (for ``x_6``) and ``f^_5``; then chains one-token calls, ``(f^_5, d_1)`` at
position 5 gives ``d_2``, and so on while the draft's probability stays at or above
``draft_confidence_threshold``. The target verifies ``[x_5, d_1, d_2]`` at positions 5..7 and
accepts, say, ``d_1`` plus a bonus ``b``: hidden states of positions 5 and 6 arrive, and the next
catch-up writes the pairs ``(f_5, d_1)``, ``(f_6, b)`` at positions 5 and 6, over what the chain
wrote there; slots past them hold stale chain KV that no query sees (the mask is ``j <= p``).

**Medusa** (no cache): the last known hidden state ``f_{t}`` goes through ``num_heads`` heads at
once; head ``k`` drafts ``x_{t+2+k}``, the drafts cut at the first one below the threshold.

Drafts are the head's argmax, point masses for the verifier: greedy output stays the target's own,
and a sampled request stays lossless under the ``min(1, p / q)`` rule with ``q`` a point mass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qspec import contract
from qspec.errors import ConfigError
from qspec.head_manifest import MASK_HIDDEN_FILE, HeadManifest, has_head, read_draft_ids, read_head_manifest
from qspec.runtime.head_graph import HeadGraph
from qspec.runtime.head_rows import HeadRequest, HeadRow, softmax_top
from qspec.runtime.load import load_head_graph
from qspec.runtime.proposal import DepthLimit, Proposal, Proposer, RequestId, Tokens, as_tokens
from qspec.runtime.sampling import SamplingParams
from qspec.specializations import Specialization

CHAIN_MS_DECAY = 0.1  # weight of the newest chained call in EagleProposer.chain_ms
# A parallel head whose mask drafts dispatch would not verify drafts chained (as EAGLE-1) and tries its mask pairs
# again after this many steps (EagleProposer.draft_in_one_call).
MASK_RETRY_STEPS = 16
DEFAULT_THRESHOLD = 0.5  # a chain of drafts less likely than this (product of probabilities) ends the row's drafts


class HiddenStateProposer(Proposer):
    """A proposer that reads the target's hidden states (declared: the engine checks ``wants_hidden_states``).

    A subclass is one runtime method of :data:`HEAD_PROPOSERS`: it says how it is built from a package's head
    (:meth:`from_manifest`), what one call of its graph reads (:meth:`call_feeds`) and whether it calls the head
    once per draft (``chained``).
    """

    wants_hidden_states = True
    chained = False  # one head call per draft (EAGLE), else one call for every draft (Medusa)

    @classmethod
    def from_manifest(cls, graphs: list[HeadGraph], draft_ids, manifest: HeadManifest, *, threshold: float):
        """The proposer of a package's head (its graphs loaded: one per program, ``HeadManifest.programs``)."""
        rows = manifest.full_batch_size or 1
        return cls(
            graphs[0],
            draft_ids,
            ctx_len=manifest.ctx_len or 0,
            hidden_size=manifest.hidden_size,
            rows=rows,
            threshold=threshold,
        )

    @staticmethod
    def call_feeds(
        manifest: HeadManifest, spec: Specialization, hidden: np.ndarray, *, start: int = 0, token: int = 0
    ) -> dict[str, np.ndarray]:
        """Inputs (but the KV) of one call of ``spec``'s shape: ``hidden`` [rows, seq_len, H], every row live."""
        return {contract.HIDDEN_STATES: hidden}

    def __init__(
        self,
        head: HeadGraph,
        draft_ids: np.ndarray | None,
        *,
        ctx_len: int,
        hidden_size: int,
        rows: int,
        threshold: float,
    ):
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"draft_confidence_threshold {threshold} must be in [0, 1]")
        self.head = head
        self.draft_ids = draft_ids
        self.ctx_len, self.hidden_size, self.rows = ctx_len, hidden_size, rows  # ctx_len 0: the head has no cache
        self.buffer_len = ctx_len  # positions of hidden states kept per request: the target's ctx_len once known
        self.threshold = threshold
        self.depth_limit: DepthLimit | None = None  # the engine's dispatch (limit_depth)
        self._requests: dict[RequestId, HeadRequest] = {}

    def check_target(self, *, vocab_size: int, ctx_len: int, num_slots: int) -> None:
        if self.ctx_len and num_slots > self.rows:
            raise ConfigError(f"the head has {self.rows} KV rows for {num_slots} sequences in flight; recompile")
        if self.ctx_len and ctx_len > self.ctx_len:
            raise ConfigError(f"the head's ctx_len {self.ctx_len} is shorter than the target's {ctx_len}; recompile")
        self.buffer_len = ctx_len

    def start(self, request_id, prompt_tokens, params: SamplingParams | None = None, rng=None) -> None:
        used = {r.row for r in self._requests.values()}
        row = next((r for r in range(self.rows) if r not in used), 0)  # a head without a cache has no rows to share
        hidden = np.zeros((self.buffer_len, self.hidden_size), np.float32)
        greedy = params is None or params.greedy
        self._requests[request_id] = HeadRequest(row, as_tokens(prompt_tokens).tolist(), hidden, greedy=greedy)

    def limit_depth(self, useful: DepthLimit | None) -> None:
        self.depth_limit = useful

    def observe_hidden(self, request_id: RequestId, start: int, hidden: np.ndarray) -> None:
        request = self._requests[request_id]
        request.hidden[start : start + len(hidden)] = hidden
        request.known = max(request.known, start + len(hidden))
        request.cached = min(request.cached, start)  # pairs from `start` on get the verified features

    def extend(self, request_id: RequestId, new_tokens: Tokens) -> None:
        self._requests[request_id].tokens.extend(as_tokens(new_tokens).tolist())

    def finish(self, request_id: RequestId) -> None:
        self._requests.pop(request_id, None)

    def propose(self, request_id: RequestId, k: int) -> np.ndarray:
        return self.propose_batch([(request_id, k)])[0].tokens

    def to_target(self, draft: np.ndarray) -> np.ndarray:
        return draft if self.draft_ids is None else self.draft_ids[draft]


class EagleProposer(HiddenStateProposer):
    """EAGLE drafts (EAGLE-1 and EAGLE-3): a catch-up call over the new pairs, then chained one-token calls
    (module doc). It runs MTP layers too (method ``mtp``): one graph per layer, ``chain``; the catch-up runs
    layer 0 and draft ``j + 1`` comes from layer ``j % n`` (vLLM's ``spec_step_idx % num_mtp_layers``: each step
    its own layer, one layer chained). Example, two layers, K = 3: layer 0 catches up and drafts ``d_1``, layer 1
    reads ``d_1`` and drafts ``d_2``, layer 0 reads ``d_2`` and drafts ``d_3``. A layer ``i >= 1`` sees in its
    cache what its own chained calls wrote (as in vLLM, whose first pass alone runs over the verified tokens).
    """

    chained = True
    tree_width = 1  # 2: the runner-up of the first draft beside the chain (load_head_proposer)

    def __init__(
        self,
        head: HeadGraph,
        draft_ids,
        *,
        ctx_len: int,
        hidden_size: int,
        rows: int,
        threshold: float,
        widths: Sequence[int],
        chain: Sequence[HeadGraph] = (),
    ):
        super().__init__(head, draft_ids, ctx_len=ctx_len, hidden_size=hidden_size, rows=rows, threshold=threshold)
        self.widths = call_widths(widths)
        self.chain = list(chain) or [head]  # the graph of each draft depth, cycled (MTP layers; class doc)
        self.chain_ms = 0.0  # running mean of a row's share of a chained call (what a further draft costs)
        self.parallel: tuple[int, int, np.ndarray] | None = None  # (depth, mask token, mask feature): draft_in_one_call
        self.masks_pay, self.steps_without_masks = True, 0

    def draft_in_one_call(self, depth: int, mask_token_id: int, mask_hidden: np.ndarray) -> None:
        """Draft up to ``depth`` tokens in the catch-up call itself, mask pairs after a row's last pair
        (:mod:`qspec.heads.parallel`), instead of one chained call per further draft.

        Mask pairs widen the call (SmolLM2's head, one thread: 0.9 ms at width 2, 1.7 ms at 5): when the engine's
        dispatch would verify none of a step's mask drafts (``limit_depth``), the next steps draft chained, as an
        EAGLE-1 head (whose further calls the dispatch prices one by one), and try mask pairs again after
        ``MASK_RETRY_STEPS``."""
        self.parallel = (depth, mask_token_id, np.asarray(mask_hidden, np.float32).reshape(self.hidden_size))

    @classmethod
    def from_manifest(cls, graphs: list[HeadGraph], draft_ids, manifest: HeadManifest, *, threshold: float):
        rows = manifest.full_batch_size or 1
        widths = [spec.seq_len for spec in manifest.specializations]
        return cls(
            graphs[0],
            draft_ids,
            ctx_len=manifest.ctx_len or 0,
            hidden_size=manifest.hidden_size,
            rows=rows,
            threshold=threshold,
            widths=widths,
            chain=graphs,
        )

    @staticmethod
    def call_feeds(
        manifest: HeadManifest, spec: Specialization, hidden: np.ndarray, *, start: int = 0, token: int = 0
    ) -> dict[str, np.ndarray]:
        batch, seq = spec.batch_size, spec.seq_len
        feeds = {
            contract.INPUT_IDS: np.full((batch, seq), token, np.int64),
            contract.POSITION_IDS: np.tile(np.arange(start, start + seq, dtype=np.int64), (batch, 1)),
            contract.HIDDEN_STATES: hidden,
        }
        if manifest.continuous_batching:
            feeds[contract.BATCH_INDEX] = np.arange(batch, dtype=np.int64)[:, None]
        return feeds

    def propose_batch(self, items: Sequence[tuple[RequestId, int]]) -> list[Proposal]:
        tree = self.tree_width > 1  # a sibling of the first draft takes one of the row's slots
        rows = [HeadRow(self._requests[rid], cap - 1 if tree and cap > 1 else cap) for rid, cap in items if cap > 0]
        if rows:
            self._catch_up(rows)
            self._chain(rows)
        by_request = {id(row.request): row for row in rows}
        out = []
        for rid, cap in items:
            row = by_request.get(id(self._requests[rid])) if cap > 0 else None
            drafts = np.asarray(row.drafts, np.int64) if row and row.drafts else None
            out.append(row.proposal(tree=tree and cap > 1) if drafts is not None else Proposal.empty())
        return out

    def _call(
        self,
        rows: list[HeadRow],
        pieces: list[tuple[list[int], np.ndarray, int]],
        graph: HeadGraph | None = None,
        *,
        keep: int = 1,
    ) -> dict[str, np.ndarray]:
        """One head call: row i writes ``(tokens, hidden, start)`` = ``pieces[i]`` at positions ``start, ...``;
        the outputs hold each row's last ``keep`` rows."""
        longest = max(len(tokens) for tokens, _, _ in pieces)
        width = next((w for w in self.widths if w >= longest), longest)
        n = len(rows)
        ids = np.zeros((n, width), np.int64)
        positions = np.full((n, width), contract.PAD_POSITION, np.int64)
        hidden = np.zeros((n, width, self.hidden_size), np.float32)
        for i, (tokens, feats, start) in enumerate(pieces):
            ids[i, : len(tokens)] = tokens
            positions[i, : len(tokens)] = np.arange(start, start + len(tokens))
            hidden[i, : len(tokens)] = feats
        feeds = {contract.INPUT_IDS: ids, contract.POSITION_IDS: positions, contract.HIDDEN_STATES: hidden}
        graph = graph or self.head
        if graph.batch_index:
            feeds[contract.BATCH_INDEX] = np.asarray([[row.request.row] for row in rows], np.int64)
        return graph.run(feeds, keep=keep)

    def _catch_up(self, rows: list[HeadRow]) -> None:
        """Write every row's pairs ``(f_t, x_{t+1})`` not yet cached, widest shape first; the last call of a row
        gives its first draft."""
        depth, mask_token, mask_hidden = self.parallel or (1, 0, None)
        if depth > 1 and not (self.masks_pay or self.steps_without_masks >= MASK_RETRY_STEPS):
            depth = 1  # this step drafts chained
        self.steps_without_masks = 0 if depth > 1 else self.steps_without_masks + 1
        paid = tried = False
        limit = max(1, self.widths[-1] - (depth - 1))
        while True:
            todo = [row for row in rows if row.request.cached < min(row.request.known, len(row.request.tokens) - 1)]
            if not todo:
                break
            pieces, masks = [], []
            for row in todo:
                r = row.request
                last = min(r.known, len(r.tokens) - 1)
                end = min(last, r.cached + limit)
                tokens, hidden = r.tokens[r.cached + 1 : end + 1], r.hidden[r.cached : end]
                count = max(min(depth, row.cap) - 1, 0) if end == last else 0  # mask pairs after its last pair
                if count:
                    tokens = tokens + [mask_token] * count
                    hidden = np.concatenate((hidden, np.broadcast_to(mask_hidden, (count, self.hidden_size))))
                pieces.append((tokens, hidden, r.cached))
                masks.append(count)
            out = self._call(todo, pieces, keep=depth)
            for i, row in enumerate(todo):
                r = row.request
                r.cached += len(pieces[i][0]) - masks[i]  # the mask pairs' cache rows are overwritten next step
                if r.cached == min(r.known, len(r.tokens) - 1):  # this call held the row's last pair
                    # Each row's last rows: ``depth`` of them (a graph with batch_index hands out the head's
                    # depth whatever this step's): the last pair's row, then the mask pairs'.
                    logits, features = out[contract.LOGITS][i, -depth:], out[contract.HIDDEN_STATES_OUT][i, -depth:]
                    for j in range(depth - 1 - masks[i], depth):
                        if j > depth - 1 - masks[i] and not row.going:
                            break
                        self._take(row, logits[j], features[j])
                    if depth > 1:
                        row.going = False  # every draft came from this call
                        tried = tried or masks[i] > 0
                        paid = paid or self._verified_past_first(row)
        if tried:  # a step whose rows had room for one draft only says nothing of the mask pairs
            self.masks_pay = paid
        for row in rows:
            if row.feature is None:  # nothing new since the last step (cannot happen after a verify)
                row.going = False

    def _verified_past_first(self, row: HeadRow) -> bool:
        """Whether the engine's dispatch would verify more than the first of ``row``'s drafts."""
        if len(row.drafts) < 2:
            return False
        if self.depth_limit is None:
            return True
        return self.depth_limit(row.proposal(), row.cap, row.request.greedy, 0.0) > 1

    def _take(self, row: HeadRow, logits: np.ndarray, feature: np.ndarray) -> None:
        """Keep the head's draft unless the chain it ends is below the threshold (the first draft is always
        kept: the dispatch prices it); chain on while the chain's probability stays at or above it and the
        engine's dispatch says a further draft, at what a head call costs, would be verified (a chained draft
        costs a call whether it is verified or not; ``limit_depth``)."""
        top, prob = softmax_top(logits[None])
        confidence = row.confidence * float(prob[0])
        if not row.drafts and self.tree_width > 1:  # the runner-up, a sibling of the first draft
            second = int(np.argpartition(logits, -2)[-2])
            x = logits.astype(np.float64)
            row.sibling = (int(self.to_target(np.array([second]))[0]), float(np.exp(x[second] - x.max()) * prob[0]))
        if row.drafts and confidence < self.threshold:
            row.going = False
            return
        if not row.drafts:
            row.first = confidence
        row.drafts.append(int(self.to_target(top)[0]))
        row.survival.append(confidence)
        row.feature, row.confidence = feature.copy(), confidence  # the graph's output array is reused
        row.going = len(row.drafts) < row.cap and confidence >= self.threshold
        if row.going and self.depth_limit is not None:
            useful = self.depth_limit(row.proposal(), row.cap, row.request.greedy, self.chain_ms)
            row.going = useful > len(row.drafts)

    def _chain(self, rows: list[HeadRow]) -> None:
        while True:
            going = [row for row in rows if row.going]
            if not going:
                return
            pieces = []
            for row in going:
                position = len(row.request.tokens) - 1 + len(row.drafts) - 1  # pair (f^_{N+i-1}, d_i) at N + i - 1
                pieces.append(([row.drafts[-1]], row.feature[None], position))
            depth = len(going[0].drafts)  # the going rows chain in step: as many drafts each
            begin = time.perf_counter()
            out = self._call(going, pieces, self.chain[depth % len(self.chain)])
            share = (time.perf_counter() - begin) * 1000 / len(going)
            self.chain_ms += CHAIN_MS_DECAY * (share - self.chain_ms)
            for i, row in enumerate(going):
                self._take(row, out[contract.LOGITS][i, -1], out[contract.HIDDEN_STATES_OUT][i, -1])


class MedusaProposer(HiddenStateProposer):
    """Medusa drafts: one head call on the request's newest hidden state, cut at the first unsure head."""

    def propose_batch(self, items: Sequence[tuple[RequestId, int]]) -> list[Proposal]:
        live = [(rid, cap) for rid, cap in items if cap > 0]
        drafts: dict[RequestId, np.ndarray] = {}
        sure: dict[RequestId, float] = {}
        survival: dict[RequestId, np.ndarray] = {}
        if live:
            hidden = np.stack([self._requests[rid].hidden[self._requests[rid].known - 1] for rid, _ in live])
            logits = self.head.run({contract.HIDDEN_STATES: hidden[:, None]})[contract.LOGITS]  # [rows, heads, V]
            for (rid, cap), row in zip(live, logits):
                top, prob = softmax_top(row)
                keep = 0
                while keep < min(cap, len(top)) and (keep == 0 or prob[keep] >= self.threshold):
                    keep += 1
                if keep and prob[0] < self.threshold:
                    keep = 1
                drafts[rid] = self.to_target(top[:keep]).astype(np.int64)
                sure[rid] = float(prob[0])
                survival[rid] = np.cumprod(prob[:keep].astype(np.float64))
        return [
            Proposal(drafts[rid], confidence=sure[rid], survival=survival[rid]) if rid in drafts else Proposal.empty()
            for rid, _ in items
        ]


# The runtime's table of head methods: HeadManifest.method -> its proposer. A head kind
# (qspec.heads.kinds.KINDS) names one of these; the CLI's head methods are these and their +pld.
HEAD_PROPOSERS: dict[str, type[HiddenStateProposer]] = {
    "eagle": EagleProposer,
    "medusa": MedusaProposer,
    "mtp": EagleProposer,  # a checkpoint's MTP layers: EAGLE's steps, a graph per layer (EagleProposer's doc)
}
HEAD_METHOD_ALIASES = {"eagle3": "eagle"}  # EAGLE-3 heads run as EAGLE (the package holds one kind)


def call_widths(compiled: Sequence[int]) -> list[int]:
    """The widths a head call is padded to: the head's compiled ``seq_len`` values and the powers of two below
    the widest. The head runs in ONNX Runtime, which takes any width, and a call costs about its width in
    tokens (SmolLM2's EAGLE head, one thread: 0.7 ms at 1, 2.5 ms at 8, 15.9 ms at 64), so a row catching up
    six tokens after a pause pays for 8, not for the 64 of the widest compiled shape. Example: compiled
    ``[1, 5, 64]`` -> ``[1, 2, 4, 5, 8, 16, 32, 64]``."""
    widest = max(compiled)
    return sorted(set(compiled) | {1 << i for i in range(widest.bit_length()) if 1 << i < widest})


def head_proposer(method: str) -> type[HiddenStateProposer]:
    """The proposer class of a head method, or an error naming the known ones."""
    proposer = HEAD_PROPOSERS.get(HEAD_METHOD_ALIASES.get(method, method))
    if proposer is None:
        raise ConfigError(f"unknown head method {method!r}; this qspec runs {', '.join(HEAD_PROPOSERS)}: recompile")
    return proposer


def load_head_proposer(
    method: str,
    package: str | Path,
    *,
    draft_confidence_threshold: float | None = None,
    num_threads: int | None = 1,
    tree_width: int | None = None,
    parallel_drafting: bool = True,
) -> HiddenStateProposer:
    """The ``method`` proposer of ``package``'s draft head (``qspec compile --draft-head``); ``tree_width`` 2: an
    EAGLE head also offers its runner-up for the first draft, beside the chain (a tree, :mod:`qspec.runtime.layout`).
    A head trained to draft in one call (:mod:`qspec.heads.parallel`) does so unless ``parallel_drafting`` is False."""
    if tree_width is not None and tree_width not in (1, 2):
        raise ConfigError(f"tree_width {tree_width}: use 1 (a chain) or 2 (the head's runner-up at depth 1)")
    method = HEAD_METHOD_ALIASES.get(method, method)
    if not has_head(package):
        if method == "mtp":
            fix = "compile it with `qspec compile MODEL --mtp`"
            raise ConfigError(f"method mtp needs the MTP layers of the target in {package}; {fix}")
        raise ConfigError(
            f"method {method} needs a draft head in {package}; compile it with `qspec compile ... --draft-head DIR`"
        )
    manifest = read_head_manifest(package)
    if manifest.method != method:
        raise ConfigError(f"{package}'s draft head is {manifest.method}; use --method {manifest.method}")
    threshold = DEFAULT_THRESHOLD if draft_confidence_threshold is None else draft_confidence_threshold
    rows = manifest.full_batch_size or 1
    graphs = [
        load_head_graph(
            manifest.path(package, manifest.runtime_graph, i), rows=rows, kv=manifest.kv_shape, num_threads=num_threads
        )
        for i in range(manifest.programs)
    ]
    proposer = head_proposer(manifest.method).from_manifest(
        graphs, read_draft_ids(package, manifest), manifest, threshold=threshold
    )
    if (tree_width or 1) > 1:
        if not isinstance(proposer, EagleProposer):
            raise ConfigError(f"tree_width {tree_width} is for an EAGLE head; {manifest.method} drafts chains")
        proposer.tree_width = tree_width
    if manifest.parallel_depth and parallel_drafting and isinstance(proposer, EagleProposer):
        mask = np.load(manifest.path(package, manifest.mask_hidden_file or MASK_HIDDEN_FILE))
        proposer.draft_in_one_call(manifest.parallel_depth, manifest.mask_token_id or 0, mask)
    return proposer
