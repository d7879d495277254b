"""Suffix decoding: drafts from counted continuations of the history's suffix (SuffixDecoding).

As in vLLM's ``suffix`` method (Snowflake ArcticInference), two depth-bounded suffix tries count
every substring of at most ``max_depth`` tokens:

- a **request tree** over the request's prompt and generated tokens;
- a **global tree** over the outputs of earlier finished requests of the same proposer, at most
  ``max_cached_requests`` of them (the least recently added is evicted first).

A node stands for a substring ``s``; its count is the number of positions where ``s`` ends. So
``count(s + t) / count(s)`` estimates the probability that ``t`` follows ``s``.

To propose, each suffix of the history found in a tree (its *match*) is continued greedily: take
the most frequent child, multiply the running probability by ``child / parent``, stop when it
falls below ``min_token_prob`` or the draft reaches ``min(k, max_spec_factor * match_length)``
tokens. A draft's score is the sum of its running probabilities: the expected number of accepted
drafts if the counts were the truth. Every match length is tried, as ArcticInference does — in a
depth-bounded tree the longest match leaves the least room to continue — and the best score of
either tree wins (ties -> the longer match, then the request tree).

Worked example, history ``[1, 2, 3, 1, 2]``, ``max_spec_factor=1``, ``k=4``:

- request tree: ``[1, 2]`` ends at positions 1 and 4; the occurrence at 4 is the history's own end
  and has no continuation yet, so it is not counted: ``P(3 | 1 2) = 1/1``, ``P(1 | 1 2 3) = 1/1``;
- match length 2 allows 2 tokens: ``[3, 1]`` with score 2.0; match ``[2]`` allows 1: ``[3]``,
  score 1.0; ``[3, 1, 2]`` only occurs at the end: no match. Drafts: ``[3, 1]``.

Cost: appending a token touches ``max_depth`` nodes of the request tree (and, while the global
tree is unchanged, ``max_depth`` look-ups in it); a proposal walks at most ``max_depth * k``
nodes. Memory is up to ``max_depth`` nodes per token held.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from qspec.errors import ConfigError
from qspec.runtime.proposal import Proposal, Proposer, RequestId, Tokens, unknown_request
from qspec.runtime.sampling import SamplingParams

DEFAULT_MAX_TREE_DEPTH = 24
# vLLM uses 10,000; Python trie nodes cost ~250 B per (token, depth), so cap memory at a few hundred MB.
DEFAULT_MAX_CACHED_REQUESTS = 256
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1
# Proposal.match_len of suffix drafts: matches of this many tokens or more are one class for dispatch.
MATCH_LEN_CLASSES = 8


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _as_list(tokens: Tokens) -> list[int]:
    arr = np.asarray(tokens, dtype=np.int64)
    assert arr.ndim == 1, f"tokens must be 1-D, got shape {arr.shape}"
    return arr.tolist()


class Node:
    """A substring: how many positions it ends at, and its one-token extensions."""

    __slots__ = ("count", "children", "_best", "_best_stale")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] | None = None  # None until the first child: most nodes are leaves
        self._best: int | None = None  # most frequent child, ties -> lowest token id
        self._best_stale = False

    def add_child(self, token: int) -> Node:
        """The child for ``token`` (created if new), its count incremented."""
        if self.children is None:
            self.children = {}
        child = self.children.get(token)
        if child is None:
            child = self.children[token] = Node()
        child.count += 1
        best = self._best
        if not self._best_stale and (
            best is None or (c := self.children[best].count) < child.count or (c == child.count and token < best)
        ):
            self._best = token
        return child

    def remove_child(self, token: int) -> Node:
        """The child for ``token``, its count decremented; dropped from the tree at zero."""
        assert self.children is not None and token in self.children, f"no child {token} to remove"
        child = self.children[token]
        child.count -= 1
        if child.count == 0:
            del self.children[token]
        if token == self._best:
            self._best_stale = True
        return child

    def best_child(self) -> int | None:
        """The most frequent next token (ties -> the lowest id), or None for a leaf."""
        if self._best_stale:
            self._best_stale = False
            items = self.children.items() if self.children else ()
            self._best = max(items, key=lambda kv: (kv[1].count, -kv[0]), default=(None,))[0]
        return self._best


# A frontier lists, for j = 0, 1, ..., the node of the history's last j tokens (frontier[0] is
# the root), as far as the tree holds them: if a suffix is absent, so are all longer ones.
Frontier = list[Node]


# --------------------------------------------------------------------------------------------
# Core: the depth-bounded suffix trie
# --------------------------------------------------------------------------------------------


class SuffixTrie:
    """Counts of every substring of at most ``max_depth`` tokens of the sequences added to it."""

    def __init__(self, max_depth: int = DEFAULT_MAX_TREE_DEPTH) -> None:
        self.max_depth = max_depth
        self.root = Node()

    def frontier(self) -> Frontier:
        """The frontier of an empty history."""
        return [self.root]

    def add(self, frontier: Frontier, tokens: Tokens) -> Frontier:
        """Count ``tokens`` appended after the frontier's history; the new frontier. O(depth) per token."""
        depth = self.max_depth
        for token in _as_list(tokens):
            self.root.count += 1
            frontier = [self.root] + [node.add_child(token) for node in frontier[:depth]]
        return frontier

    def remove(self, tokens: Tokens) -> None:
        """Uncount a sequence that was added, from an empty frontier, as ``tokens``."""
        depth = self.max_depth
        frontier = self.frontier()
        for token in _as_list(tokens):
            self.root.count -= 1
            frontier = [self.root] + [node.remove_child(token) for node in frontier[:depth]]

    def follow(self, frontier: Frontier, tokens: Tokens) -> Frontier:
        """The frontier after ``tokens``, without counting them (a look-up, O(depth) per token)."""
        depth = self.max_depth
        for token in _as_list(tokens):
            nxt = [self.root]
            for node in frontier[:depth]:
                child = node.children.get(token) if node.children else None
                if child is None:
                    break
                nxt.append(child)
            frontier = nxt
        return frontier

    def speculate(
        self, frontier: Frontier, k: int, *, max_spec_factor: float, min_token_prob: float, own: bool
    ) -> tuple[list[int], float, int]:
        """``(draft, score, match_len)``: the best-scoring draft of at most ``k`` tokens continuing a
        match in ``frontier``, and the length of that match.

        ``own``: the frontier's history is in this tree, so each of its suffixes has one
        occurrence (at the history's end) that has no continuation yet and is not counted.
        """
        best: tuple[list[int], float, int] = ([], 0.0, 0)
        for match_len in range(len(frontier) - 1, 0, -1):
            limit = min(k, int(max_spec_factor * match_len + 1e-9))
            draft, score = self._walk(frontier, match_len, limit, min_token_prob, own)
            if score > best[1]:
                best = (draft, score, match_len)
        return best

    def _walk(
        self, frontier: Frontier, depth: int, limit: int, min_token_prob: float, own: bool
    ) -> tuple[list[int], float]:
        """Greedy most-frequent-child walk from ``frontier[depth]``: (draft, sum of running probs)."""
        node = frontier[depth]
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit:
            token = node.best_child()
            if token is None:
                break
            child = node.children[token]  # type: ignore[index]
            parent_count = node.count - (own and depth < len(frontier) and frontier[depth] is node)
            prob *= child.count / parent_count
            if prob < min_token_prob:
                break
            draft.append(token)
            score += prob
            node, depth = child, depth + 1
        return draft, score


# --------------------------------------------------------------------------------------------
# Proposer
# --------------------------------------------------------------------------------------------


@dataclass
class _Request:
    tree: SuffixTrie
    frontier: Frontier
    tokens: list[int]
    prompt_len: int
    global_frontier: Frontier | None = None  # None: recompute (the global tree changed)
    global_version: int = -1


class SuffixProposer(Proposer):
    """Suffix decoding ("suffix"): a request tree plus a global tree over earlier outputs."""

    def __init__(
        self,
        suffix_decoding_max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH,
        suffix_decoding_max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
        suffix_decoding_max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
        suffix_decoding_min_token_prob: float = DEFAULT_MIN_TOKEN_PROB,
    ) -> None:
        if suffix_decoding_max_tree_depth < 1:
            raise ConfigError(f"suffix_decoding_max_tree_depth={suffix_decoding_max_tree_depth} must be >= 1")
        if suffix_decoding_max_cached_requests < 0:
            raise ConfigError(
                f"suffix_decoding_max_cached_requests={suffix_decoding_max_cached_requests} must be >= 0 "
                "(0 disables the global tree)"
            )
        if not suffix_decoding_max_spec_factor > 0:
            raise ConfigError(f"suffix_decoding_max_spec_factor={suffix_decoding_max_spec_factor} must be > 0")
        if not 0 <= suffix_decoding_min_token_prob <= 1:
            raise ConfigError(f"suffix_decoding_min_token_prob={suffix_decoding_min_token_prob} must be in [0, 1]")
        self.max_tree_depth = suffix_decoding_max_tree_depth
        self.max_cached_requests = suffix_decoding_max_cached_requests
        self.max_spec_factor = suffix_decoding_max_spec_factor
        self.min_token_prob = suffix_decoding_min_token_prob
        self.global_tree = SuffixTrie(self.max_tree_depth)
        self._global_version = 0  # bumped at each change: request frontiers into it go stale
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # outputs in the global tree
        self._next_cache_key = 0
        self._requests: dict[RequestId, _Request] = {}

    def _request(self, request_id: RequestId) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise unknown_request(request_id) from None

    def start(
        self,
        request_id: RequestId,
        prompt_tokens: Tokens,
        params: SamplingParams | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        tokens = _as_list(prompt_tokens)
        tree = SuffixTrie(self.max_tree_depth)
        frontier = tree.add(tree.frontier(), tokens)
        self._requests[request_id] = _Request(tree, frontier, tokens, prompt_len=len(tokens))

    def extend(self, request_id: RequestId, new_tokens: Tokens) -> None:
        req = self._request(request_id)
        new = _as_list(new_tokens)
        req.tokens.extend(new)
        req.frontier = req.tree.add(req.frontier, new)
        if req.global_frontier is not None and req.global_version == self._global_version:
            req.global_frontier = self.global_tree.follow(req.global_frontier, new)
        else:
            req.global_frontier = None

    def _global_frontier(self, req: _Request) -> Frontier:
        if req.global_frontier is None or req.global_version != self._global_version:
            tail = req.tokens[-self.max_tree_depth :]
            req.global_frontier = self.global_tree.follow(self.global_tree.frontier(), tail)
            req.global_version = self._global_version
        return req.global_frontier

    def propose(self, request_id: RequestId, k: int) -> np.ndarray:
        return self.proposal(request_id, k).tokens

    def proposal(self, request_id: RequestId, k: int) -> Proposal:
        """The best-scoring draft of the request's own tree and the global one, with its match length."""
        req = self._request(request_id)
        if k <= 0:
            return Proposal.empty()
        knobs = dict(max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
        draft, score, match_len = req.tree.speculate(req.frontier, k, own=True, **knobs)
        if self._cached:
            other = self.global_tree.speculate(self._global_frontier(req), k, own=False, **knobs)
            if other[1] > score:
                draft, score, match_len = other
        return Proposal(np.asarray(draft, dtype=np.int64), match_len=min(match_len, MATCH_LEN_CLASSES) if draft else 0)

    def finish(self, request_id: RequestId) -> None:
        """Forget the request; its output (tokens after the prompt) joins the global tree."""
        req = self._requests.pop(request_id, None)
        if req is None or self.max_cached_requests == 0:
            return
        output = req.tokens[req.prompt_len :]
        if not output:
            return
        self.global_tree.add(self.global_tree.frontier(), output)
        self._cached[self._next_cache_key] = output
        self._next_cache_key += 1
        while len(self._cached) > self.max_cached_requests:
            _, evicted = self._cached.popitem(last=False)
            self.global_tree.remove(evicted)
        self._global_version += 1
