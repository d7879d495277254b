"""Prefix reuse across requests: a finished request's KV stays in its slot, and a new request whose prompt
starts with what an idle slot holds takes that slot and prefills only the rest (vLLM's automatic prefix
caching, llama.cpp server's slot reuse, on whole slots).

Why it is exact: the graph writes a call's KV at ``position_ids`` and a query at position p sees key slot j
iff ``j <= p`` (the KV contract). A request that keeps the first ``n`` positions of a slot writes positions
``n, n + 1, ...`` itself before any of its queries reaches them, so it never sees the previous owner's KV
past the shared prefix; the shared positions hold the KV of the same tokens at the same positions.
Padding writes back what its slot holds, so no chunk's padding (prefill or mixed) changes a kept prefix.

>>> cache = PrefixCache(3, enabled=True)
>>> cache.take([1, 2, 3], free=[0, 1, 2])      # nothing cached: the least recently used slot, no reuse
(0, 0)
>>> cache.release(0, [1, 2, 3, 9, 9])           # the request's prompt and output are in slot 0's KV
>>> cache.take([1, 2, 3, 9, 9, 7], free=[0, 1, 2])  # the next turn extends slot 0 whole: prefill 1
(0, 5)
>>> cache.release(0, [1, 2, 3, 9, 9, 7, 5])
>>> cache.take([1, 2, 4], free=[0, 1, 2])       # another conversation: an unused slot, not slot 0's cache
(1, 0)
>>> cache.take([1, 2, 4], free=[0])             # no other slot left: the longest shared prefix
(0, 2)
>>> cache.queries, cache.hits
(15, 7)
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """What each KV slot holds once its request is done, and the choice of slot for a new prompt.

    ``queries`` and ``hits`` count prompt tokens looked up and found (vLLM's ``prefix_cache_queries`` /
    ``prefix_cache_hits``). Disabled, a prompt takes the first free slot and reuses nothing.
    """

    def __init__(self, num_slots: int, *, enabled: bool):
        self.enabled = enabled
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]  # the KV of an idle slot, by position
        self._used = [0] * num_slots  # when each slot was last released (0: never: emptiest first)
        self._clock = 0
        self.queries = 0
        self.hits = 0

    def take(self, prompt: Sequence[int], free: Sequence[int]) -> tuple[int, int]:
        """``(slot, reused)``: the free slot for ``prompt`` and how many of its first tokens are already there.

        A slot whose cached tokens the prompt starts with whole (the conversation's own slot; an unused slot)
        wins, the longest first: a prompt does not overwrite another conversation's prefix while a slot is
        unused. Without one, the slot sharing the longest prefix, the least recently used on ties (keeping
        warm prefixes for their conversations). ``reused < len(prompt)``: the last token's logits are needed.
        """
        if not self.enabled:
            return free[0], 0
        common = {slot: common_prefix(self._tokens[slot], prompt) for slot in free}
        whole = {slot: common[slot] == len(self._tokens[slot]) for slot in free}
        slot = max(free, key=lambda s: (whole[s], common[s], -self._used[s]))
        reused = min(common[slot], len(prompt) - 1)
        self.queries += len(prompt)
        self.hits += reused
        self._tokens[slot] = []  # its owner writes past the prefix from now on
        return slot, reused

    def release(self, slot: int, tokens: Sequence[int]) -> None:
        """Slot ``slot`` is idle and its KV holds ``tokens`` at positions ``0 .. len(tokens) - 1``."""
        if self.enabled:
            self._clock += 1
            self._tokens[slot], self._used[slot] = list(tokens), self._clock

    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None
