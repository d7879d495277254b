"""Proposers: where draft tokens come from, as pure functions on token arrays with thin classes.

Terms used across the runtime:

- **proposed** tokens (drafts) are what a proposer offers for one step, at most ``k`` of them;
- **accepted** tokens are the longest prefix of the drafts the target model agrees with;
- the **bonus** token is the one the target model adds after the accepted drafts.

Every proposer is a :class:`~qspec.runtime.proposal.Proposer`: ``start`` a request with its
prompt, ``extend`` it with the tokens a step accepted (accepted drafts and bonus), ``propose`` at
most ``k`` drafts for the next step, ``finish`` it. A proposer only ever sees tokens that are part
of the request's final output; it never has to forget rejected drafts.

Methods, all from one registry (:func:`make_proposer`): ``none``, ``pld`` (prompt lookup,
:func:`find_longest_ngram`), ``user`` (the caller's drafts), ``suffix``
(:mod:`qspec.runtime.suffix`) and ``draft`` (a draft model, :mod:`qspec.runtime.draft`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from qspec.errors import ConfigError
from qspec.runtime.heads import HEAD_METHOD_ALIASES, HEAD_PROPOSERS
from qspec.runtime.proposal import Proposal, Proposer, RequestId, Tokens, as_tokens, unknown_request
from qspec.runtime.sampling import SamplingParams
from qspec.runtime.suffix import SuffixProposer

Rng = np.random.Generator | None

__all__ = [
    "PROPOSER_METHODS",
    "NoProposer",
    "PromptLookup",
    "PromptLookupProposer",
    "Proposal",
    "Proposer",
    "SuffixProposer",
    "UserProposer",
    "find_longest_ngram",
    "make_proposer",
]

DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 3

_EMPTY = np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def check_ngram_range(min_n: int, max_n: int) -> None:
    """Raise ConfigError unless ``1 <= prompt_lookup_min <= prompt_lookup_max``."""
    if min_n < 1:
        raise ConfigError(f"prompt_lookup_min={min_n} must be >= 1 (an n-gram has at least one token)")
    if max_n < min_n:
        raise ConfigError(
            f"prompt_lookup_max={max_n} < prompt_lookup_min={min_n}: "
            "give a maximum n-gram size at least as large as the minimum"
        )


def _pick_match(ends: Sequence[int], last: int, k: int, *, size: int | None = None) -> int:
    """Among match end positions ``ends[:size]`` (ascending, all ``< last``), the one to continue from.

    The continuation after end ``e`` has ``min(k, last - e)`` tokens. The longest wins; among
    equally long ones (all that reach ``k``) the most recent: the largest ``e <= last - k``, or,
    when no match has ``k`` tokens after it, the earliest.
    """
    i = bisect.bisect_right(ends, last - k, 0, len(ends) if size is None else size)
    return ends[i - 1] if i > 0 else ends[0]


# --------------------------------------------------------------------------------------------
# Core: prompt lookup
# --------------------------------------------------------------------------------------------


def find_longest_ngram(tokens: Tokens, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Prompt lookup: the tokens that followed an earlier occurrence of the history's last n-gram.

    For ``n`` from ``max_n`` down to ``min_n``, the last ``n`` tokens are the pattern; its
    earlier occurrences are those that end before the last position. The first ``n`` with any
    occurrence decides; among all its occurrences the longest available continuation wins (up to
    ``k`` tokens; ties -> the most recent occurrence). No occurrence for any ``n``: empty.

    Example, ``tokens = [1, 2, 3, 4, 2, 3]``, ``min_n=1, max_n=3``:

    - n=3, pattern ``[4, 2, 3]``: no earlier occurrence;
    - n=2, pattern ``[2, 3]``: one at positions 1..2, followed by ``[4, 2, 3]``;
    - so ``k=3`` -> ``[4, 2, 3]``, ``k=2`` -> ``[4, 2]``, ``k=5`` -> ``[4, 2, 3]`` (all there is).

    With ``tokens = [1, 2, 9, 1, 2, 7, 8, 1, 2]`` the pattern ``[1, 2]`` occurs at 0..1 (7 tokens
    follow) and 3..4 (4 tokens follow): ``k=3`` -> ``[7, 8, 1]`` (both have 3, the most recent
    wins), ``k=5`` -> ``[9, 1, 2, 7, 8]`` (only the first has 5).

    Returns an int64 array of at most ``k`` tokens.
    """
    check_ngram_range(min_n, max_n)
    arr = as_tokens(tokens)
    last = arr.shape[0] - 1
    if k <= 0 or last < 1:
        return _EMPTY.copy()
    for n in range(min(max_n, last), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # [last - n + 1, n]
        starts = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if starts.size:
            end = _pick_match((starts + n - 1).tolist(), last, k)
            return arr[end + 1 : end + 1 + k].copy()
    return _EMPTY.copy()


class PromptLookup:
    """Incremental prompt lookup over one growing history: same answers as find_longest_ngram.

    Keeps, for every n-gram with ``min_n <= n <= max_n``, the ascending list of positions where
    it ends. Appending a token adds at most ``max_n - min_n + 1`` entries; a proposal is a few
    dict look-ups and a bisect, never a rescan of the history.
    """

    def __init__(self, min_n: int = DEFAULT_PROMPT_LOOKUP_MIN, max_n: int = DEFAULT_PROMPT_LOOKUP_MAX) -> None:
        check_ngram_range(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Tokens) -> None:
        """Append ``tokens`` to the history and index the n-grams that end at each of them."""
        for token in as_tokens(tokens).tolist():
            self.tokens.append(token)
            last = len(self.tokens) - 1
            for n in range(self.min_n, min(self.max_n, last + 1) + 1):
                self._ends.setdefault(tuple(self.tokens[last - n + 1 :]), []).append(last)

    def propose(self, k: int) -> np.ndarray:
        """At most ``k`` drafts: ``find_longest_ngram(history, min_n, max_n, k)``."""
        return self.propose_match(k)[0]

    def propose_match(self, k: int) -> tuple[np.ndarray, int]:
        """``(drafts, n)``: :meth:`propose`'s drafts and the length of the n-gram they continue (0: none)."""
        last = len(self.tokens) - 1
        if k <= 0 or last < 1:
            return _EMPTY.copy(), 0
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            ends = self._ends[tuple(self.tokens[last - n + 1 :])]
            # The pattern itself is the last entry (it ends at `last`); only earlier ones count.
            if len(ends) > 1:
                end = _pick_match(ends, last, k, size=len(ends) - 1)
                return np.asarray(self.tokens[end + 1 : end + 1 + k], dtype=np.int64), n
        return _EMPTY.copy(), 0


# --------------------------------------------------------------------------------------------
# Proposers
# --------------------------------------------------------------------------------------------


class NoProposer(Proposer):
    """Proposes nothing: every step is a plain decode (K=0 when compiled)."""

    def start(
        self, request_id: RequestId, prompt_tokens: Tokens, params: SamplingParams | None = None, rng: Rng = None
    ) -> None:
        pass

    def extend(self, request_id: RequestId, new_tokens: Tokens) -> None:
        pass

    def propose(self, request_id: RequestId, k: int) -> np.ndarray:
        return _EMPTY.copy()

    def finish(self, request_id: RequestId) -> None:
        pass


class PromptLookupProposer(Proposer):
    """Prompt lookup decoding ("pld") over each request's prompt and generated tokens."""

    def __init__(
        self,
        prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN,
        prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX,
    ) -> None:
        check_ngram_range(prompt_lookup_min, prompt_lookup_max)
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._lookups: dict[RequestId, PromptLookup] = {}

    def start(
        self, request_id: RequestId, prompt_tokens: Tokens, params: SamplingParams | None = None, rng: Rng = None
    ) -> None:
        lookup = PromptLookup(self.prompt_lookup_min, self.prompt_lookup_max)
        lookup.extend(prompt_tokens)
        self._lookups[request_id] = lookup

    def _lookup(self, request_id: RequestId) -> PromptLookup:
        try:
            return self._lookups[request_id]
        except KeyError:
            raise unknown_request(request_id) from None

    def extend(self, request_id: RequestId, new_tokens: Tokens) -> None:
        self._lookup(request_id).extend(new_tokens)

    def propose(self, request_id: RequestId, k: int) -> np.ndarray:
        return self._lookup(request_id).propose(k)

    def proposal(self, request_id: RequestId, k: int) -> Proposal:
        """The drafts with the length of the n-gram they continue (a 3-gram's are accepted far more often)."""
        drafts, n = self._lookup(request_id).propose_match(k)
        return Proposal(drafts, match_len=n if len(drafts) else 0)

    def finish(self, request_id: RequestId) -> None:
        self._lookups.pop(request_id, None)


DraftFn = Callable[[RequestId, np.ndarray], Tokens]


class UserProposer(Proposer):
    """The caller's drafts: queued with :meth:`set_drafts`, or computed by ``fn(request_id, history)``.

    Queued drafts come first. As a step's tokens are appended, the drafts they confirm are popped
    from the head of the queue; the first disagreement clears the queue (what follows a rejected
    draft is no longer a continuation of the history). With the queue empty, ``fn`` (if any) is
    asked at each proposal; its answer is not queued.

    Example: ``set_drafts(r, [5, 6, 7])``; ``propose(r, 2)`` -> ``[5, 6]``; ``extend(r, [5, 9])``
    (5 accepted, 9 the bonus) clears the queue, whereas ``extend(r, [5])`` would leave ``[6, 7]``.
    """

    def __init__(self, fn: DraftFn | None = None) -> None:
        self.fn = fn
        self._history: dict[RequestId, list[int]] = {}
        self._queue: dict[RequestId, list[int]] = {}

    def _check(self, request_id: RequestId) -> None:
        if request_id not in self._history:
            raise unknown_request(request_id)

    def start(
        self, request_id: RequestId, prompt_tokens: Tokens, params: SamplingParams | None = None, rng: Rng = None
    ) -> None:
        self._history[request_id] = as_tokens(prompt_tokens).tolist()
        self._queue[request_id] = []

    def set_drafts(self, request_id: RequestId, tokens: Tokens) -> None:
        """Queue ``tokens`` as the drafts of the next steps (replacing any queued ones)."""
        self._check(request_id)
        self._queue[request_id] = as_tokens(tokens).tolist()

    def extend(self, request_id: RequestId, new_tokens: Tokens) -> None:
        self._check(request_id)
        new = as_tokens(new_tokens).tolist()
        self._history[request_id].extend(new)
        queue = self._queue[request_id]
        m = min(len(new), len(queue))
        if new[:m] == queue[:m]:
            del queue[:m]
        else:
            queue.clear()

    def propose(self, request_id: RequestId, k: int) -> np.ndarray:
        self._check(request_id)
        if k <= 0:
            return _EMPTY.copy()
        queue = self._queue[request_id]
        if queue:
            return np.asarray(queue[:k], dtype=np.int64)
        if self.fn is None:
            return _EMPTY.copy()
        history = np.asarray(self._history[request_id], dtype=np.int64)
        return as_tokens(self.fn(request_id, history))[:k].copy()

    def finish(self, request_id: RequestId) -> None:
        self._history.pop(request_id, None)
        self._queue.pop(request_id, None)


# --------------------------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------------------------


def _head_proposer(method: str) -> Callable[..., Proposer]:
    """``eagle``/``medusa``: the package's head; ``eagle+pld``/``medusa+pld``: prompt lookup first."""

    def make(prompt_lookup_min: int | None = None, prompt_lookup_max: int | None = None, **knobs: Any) -> Proposer:
        from qspec.runtime.heads import load_head_proposer  # loads a graph: only when asked
        from qspec.runtime.lookup_first import LookupFirstProposer

        head = load_head_proposer(method.removesuffix("+pld"), **knobs)
        if not method.endswith("+pld"):
            return head
        lookup = PromptLookupProposer(
            prompt_lookup_min or DEFAULT_PROMPT_LOOKUP_MIN, prompt_lookup_max or DEFAULT_PROMPT_LOOKUP_MAX
        )
        return LookupFirstProposer(lookup, head)

    return make


def _draft_proposer(**knobs: Any) -> Proposer:
    from qspec.runtime.draft import DraftProposer  # loads a model: imported only when asked for

    return DraftProposer(**knobs)


# The target's package holds the head: the runtime's head methods and each with prompt lookup first.
HEAD_METHODS = (*HEAD_PROPOSERS, *(f"{method}+pld" for method in HEAD_PROPOSERS))
# Other names of a method (vLLM's ngram; eagle3 for the EAGLE head a package holds).
METHOD_ALIASES = {"ngram": "pld"} | {
    alias + plus: method + plus for alias, method in HEAD_METHOD_ALIASES.items() for plus in ("", "+pld")
}
_HEAD_KNOBS = ("package", "draft_confidence_threshold", "num_threads", "tree_width", "parallel_drafting")
_LOOKUP_KNOBS = ("prompt_lookup_min", "prompt_lookup_max")
# method -> (factory, its knobs, the knobs it cannot do without)
_PROPOSERS: dict[str, tuple[Callable[..., Proposer], tuple[str, ...], tuple[str, ...]]] = {
    "none": (NoProposer, (), ()),
    "pld": (PromptLookupProposer, ("prompt_lookup_min", "prompt_lookup_max"), ()),
    "user": (UserProposer, ("fn",), ()),
    "suffix": (
        SuffixProposer,
        (
            "suffix_decoding_max_tree_depth",
            "suffix_decoding_max_cached_requests",
            "suffix_decoding_max_spec_factor",
            "suffix_decoding_min_token_prob",
        ),
        (),
    ),
    "draft": (
        _draft_proposer,
        (
            "draft_package",
            "num_draft_tokens",
            "draft_confidence_threshold",
            "prefill_min_tokens",
            "session_mode",
            "spinning",
            "num_threads",
        ),
        ("draft_package",),
    ),
    # Heads that read the target's hidden states, inside the target's package (the engine passes it).
    **{
        method: (_head_proposer(method), _HEAD_KNOBS + (_LOOKUP_KNOBS if "+" in method else ()), ("package",))
        for method in HEAD_METHODS
    },
}
PROPOSER_METHODS = tuple(_PROPOSERS)
_FIXES = {
    "draft_package": "compile one with `qspec compile --num-layers N`",
    "package": "the target package holds the head: `qspec compile ... --draft-head DIR`",
}


def make_proposer(method: str, **knobs: Any) -> Proposer:
    """The proposer named ``method`` (one of :data:`PROPOSER_METHODS`), built from its knobs.

    Knobs whose value is ``None`` take their default. Knobs of another method are ignored, so a
    caller may pass one config's knobs whatever the method; a name no method knows is an error,
    and so is a missing knob the method cannot do without (``draft`` needs ``draft_package``).
    """
    if method not in _PROPOSERS:
        raise ConfigError(f"unknown speculative method {method!r}; valid methods: {', '.join(PROPOSER_METHODS)}")
    known = {name for _, names, _ in _PROPOSERS.values() for name in names}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise ConfigError(f"unknown proposer option(s) {', '.join(unknown)}; valid options: {', '.join(sorted(known))}")
    factory, names, required = _PROPOSERS[method]
    kwargs = {name: knobs[name] for name in names if knobs.get(name) is not None}
    for name in required:
        if name not in kwargs:
            raise ConfigError(f"method {method} needs {name} ({_FIXES[name]})")
    return factory(**kwargs)
