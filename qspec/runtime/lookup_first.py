"""``eagle+pld`` and ``medusa+pld``: prompt lookup where it matches a long n-gram, a draft head elsewhere."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qspec.runtime.heads import HiddenStateProposer
from qspec.runtime.proposal import DepthLimit, Proposal, Proposer, RequestId, Tokens


class LookupFirstProposer(Proposer):
    """Prompt lookup where it matches a long n-gram, the head elsewhere (``eagle+pld``, ``medusa+pld``).

    A lookup draft after a ``min_match``-gram match is accepted far more often than a head's on text
    that repeats (code edits, quotes, lists); on open text lookup finds nothing and the head drafts.
    Both follow every request; the head catches up on the steps it skipped the next time it drafts.
    """

    def __init__(self, lookup: Proposer, head: HiddenStateProposer, *, min_match: int = 2):
        self.lookup, self.head, self.min_match = lookup, head, min_match
        self.wants_hidden_states = head.wants_hidden_states

    def check_target(self, *, vocab_size: int, ctx_len: int, num_slots: int) -> None:
        self.head.check_target(vocab_size=vocab_size, ctx_len=ctx_len, num_slots=num_slots)

    def limit_depth(self, useful: DepthLimit | None) -> None:
        self.head.limit_depth(useful)

    def start(self, request_id, prompt_tokens, params=None, rng=None) -> None:
        self.lookup.start(request_id, prompt_tokens, params, rng)
        self.head.start(request_id, prompt_tokens, params, rng)

    def observe_hidden(self, request_id: RequestId, start: int, hidden: np.ndarray) -> None:
        self.head.observe_hidden(request_id, start, hidden)

    def extend(self, request_id: RequestId, new_tokens: Tokens) -> None:
        self.lookup.extend(request_id, new_tokens)
        self.head.extend(request_id, new_tokens)

    def finish(self, request_id: RequestId) -> None:
        self.lookup.finish(request_id)
        self.head.finish(request_id)

    def propose(self, request_id: RequestId, k: int) -> np.ndarray:
        return self.propose_batch([(request_id, k)])[0].tokens

    def propose_batch(self, items: Sequence[tuple[RequestId, int]]) -> list[Proposal]:
        found = self.lookup.propose_batch(items)
        short = [i for i, p in enumerate(found) if p.match_len < self.min_match and items[i][1] > 0]
        for i, proposal in zip(short, self.head.propose_batch([items[i] for i in short])):
            found[i] = proposal
        return found
