"""Prompt lookup, the proposer protocol and the proposer factory."""

from __future__ import annotations

import numpy as np
import pytest

from qspec.errors import ConfigError
from qspec.runtime.proposers import (
    NoProposer,
    PromptLookup,
    PromptLookupProposer,
    Proposer,
    UserProposer,
    find_longest_ngram,
    make_proposer,
)
from qspec.runtime.suffix import SuffixProposer


def ngram(tokens, k, min_n=1, max_n=3):
    return find_longest_ngram(tokens, min_n, max_n, k).tolist()


# --------------------------------------------------------------------------------------------
# find_longest_ngram
# --------------------------------------------------------------------------------------------


def test_docstring_example():
    """The worked example: [2, 3] recurs, followed by [4, 2, 3]."""
    tokens = [1, 2, 3, 4, 2, 3]
    assert ngram(tokens, k=3) == [4, 2, 3]
    assert ngram(tokens, k=2) == [4, 2]
    assert ngram(tokens, k=5) == [4, 2, 3]  # only 3 tokens follow the match


def test_returns_int64_array():
    """The draft is an int64 array, empty when nothing matches."""
    draft = find_longest_ngram(np.array([1, 2, 3], dtype=np.int32), 1, 3, 4)
    assert draft.dtype == np.int64 and draft.shape == (0,)
    assert find_longest_ngram([1, 2, 1], 1, 3, 4).dtype == np.int64


def test_longest_continuation_then_most_recent():
    """Among matches, the longest available continuation wins; ties go to the most recent."""
    tokens = [1, 2, 9, 1, 2, 7, 8, 1, 2]  # [1, 2] ends at 1 (7 tokens follow) and 4 (4 follow)
    assert ngram(tokens, k=3) == [7, 8, 1]  # both offer 3: the most recent
    assert ngram(tokens, k=4) == [7, 8, 1, 2]  # both offer 4: the most recent
    assert ngram(tokens, k=5) == [9, 1, 2, 7, 8]  # only the first offers 5


def test_largest_n_wins_over_longer_continuation():
    """The largest n with a match decides, even if a smaller n would continue further."""
    tokens = [2, 3, 5, 5, 5, 5, 5, 1, 2, 3, 6, 1, 2, 3]
    # n=3 [1, 2, 3] ends at 9: [6, 1, 2, 3]; n=2 [2, 3] at 1 would give [5, 5, 5, 5, 5]
    assert ngram(tokens, k=5) == [6, 1, 2, 3]
    assert ngram(tokens, k=5, max_n=2) == [5, 5, 5, 5, 5]  # [2, 3] ends at 9 (4 follow) and 1 (12)
    assert ngram(tokens, k=4, max_n=2) == [6, 1, 2, 3]  # both offer 4: the most recent


def test_match_must_end_before_last_position():
    """The pattern itself is not a match; overlapping earlier occurrences are."""
    assert ngram([7], k=3) == []  # nothing before the last token
    assert ngram([7, 7], k=3) == [7]  # [7] at 0, followed by the last 7
    assert ngram([1, 1, 1, 1], k=3) == [1]  # n=3: [1, 1, 1] at 0..2, one token follows


def test_min_n_and_k_bounds():
    """No match at n >= min_n gives nothing; k <= 0 gives nothing."""
    assert ngram([1, 2, 1], k=3, min_n=2) == []  # [2, 1] does not recur
    assert ngram([1, 2, 1], k=3, min_n=1) == [2, 1]
    assert ngram([1, 2, 3, 1, 2], k=0) == []


def test_bad_ngram_range_names_values():
    """Invalid n-gram sizes raise ConfigError naming the values."""
    with pytest.raises(ConfigError, match="prompt_lookup_min=0"):
        find_longest_ngram([1, 2], 0, 3, 2)
    with pytest.raises(ConfigError, match="prompt_lookup_max=2 < prompt_lookup_min=3"):
        PromptLookup(3, 2)


# --------------------------------------------------------------------------------------------
# PromptLookup (incremental)
# --------------------------------------------------------------------------------------------


def test_prompt_lookup_incremental_example():
    """The index answers like the pure function as tokens arrive."""
    lookup = PromptLookup(1, 3)
    lookup.extend([1, 2, 3, 4])
    assert lookup.propose(3).tolist() == []  # 4 never occurred before
    lookup.extend([2, 3])
    assert lookup.propose(3).tolist() == [4, 2, 3]
    lookup.extend([4])  # [2, 3, 4] now recurs
    assert lookup.propose(3).tolist() == [2, 3, 4]
    assert len(lookup) == 7


def test_prompt_lookup_matches_pure_function_randomized():
    """On random histories grown in random chunks, propose(k) equals find_longest_ngram."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        vocab = int(rng.integers(2, 5))  # small vocabularies: many matches and ties
        lookup = PromptLookup(min_n, max_n)
        history: list[int] = []
        while len(history) < 40:
            chunk = rng.integers(0, vocab, size=int(rng.integers(1, 6))).tolist()
            lookup.extend(chunk)
            history += chunk
            for k in (0, 1, 2, 4, 7):
                expected = find_longest_ngram(history, min_n, max_n, k)
                assert lookup.propose(k).tolist() == expected.tolist(), (history, min_n, max_n, k)


# --------------------------------------------------------------------------------------------
# Proposers
# --------------------------------------------------------------------------------------------


def test_all_proposers_follow_protocol():
    """Every proposer is a Proposer (the contract the engine relies on)."""
    for proposer in (NoProposer(), PromptLookupProposer(), UserProposer(), SuffixProposer()):
        assert isinstance(proposer, Proposer)


def test_no_proposer_proposes_nothing():
    """NoProposer always returns an empty int64 array."""
    proposer = NoProposer()
    proposer.start("r", [1, 2, 1, 2])
    proposer.extend("r", [1])
    draft = proposer.propose("r", 4)
    assert draft.dtype == np.int64 and draft.tolist() == []
    proposer.finish("r")


def test_prompt_lookup_proposer_per_request():
    """Each request has its own history: prompt plus accepted tokens."""
    proposer = PromptLookupProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    proposer.start("a", [1, 2, 3, 4])
    proposer.start("b", [9, 8, 9])
    assert proposer.propose("a", 3).tolist() == []
    assert proposer.propose("b", 3).tolist() == [8, 9]  # [9] at 0, followed by [8, 9]
    proposer.extend("a", [2, 3])  # history [1, 2, 3, 4, 2, 3]
    assert proposer.propose("a", 3).tolist() == [4, 2, 3]
    proposer.finish("a")
    with pytest.raises(KeyError, match="start"):
        proposer.propose("a", 3)
    assert proposer.propose("b", 1).tolist() == [8]


def test_user_proposer_queue_pops_confirmed_drafts():
    """Queued drafts are offered k at a time and popped as the history confirms them."""
    proposer = UserProposer()
    proposer.start("r", [1])
    proposer.set_drafts("r", [5, 6, 7, 8])
    assert proposer.propose("r", 2).tolist() == [5, 6]
    proposer.extend("r", [5])  # 5 confirmed: [6, 7, 8] left
    assert proposer.propose("r", 5).tolist() == [6, 7, 8]
    proposer.extend("r", [6, 7])
    assert proposer.propose("r", 5).tolist() == [8]
    proposer.extend("r", [8, 4])  # all consumed, 4 is a bonus past the queue
    assert proposer.propose("r", 5).tolist() == []


def test_user_proposer_mismatch_clears_queue():
    """A token that disagrees with the queue's head clears the queue."""
    proposer = UserProposer()
    proposer.start("r", [1])
    proposer.set_drafts("r", [5, 6, 7])
    proposer.extend("r", [5, 9])  # 6 rejected, 9 is the bonus
    assert proposer.propose("r", 3).tolist() == []


def test_user_proposer_callable_sees_history():
    """With the queue empty, fn(request_id, history) supplies the drafts, cut to k."""
    seen = []

    def fn(request_id, history):
        seen.append((request_id, history.tolist()))
        return [int(history[-1]) + 1, int(history[-1]) + 2, int(history[-1]) + 3]

    proposer = UserProposer(fn)
    proposer.start("r", [1, 2])
    assert proposer.propose("r", 2).tolist() == [3, 4]
    proposer.extend("r", [3])
    assert proposer.propose("r", 5).tolist() == [4, 5, 6]
    assert seen == [("r", [1, 2]), ("r", [1, 2, 3])]
    proposer.set_drafts("r", [0])  # queued drafts take precedence over fn
    assert proposer.propose("r", 5).tolist() == [0]


def test_make_proposer_methods():
    """Each method name builds its proposer; None knobs take defaults, other methods' knobs are ignored."""
    assert isinstance(make_proposer("none", prompt_lookup_max=5), NoProposer)
    pld = make_proposer("pld", prompt_lookup_min=2, prompt_lookup_max=None)
    assert isinstance(pld, PromptLookupProposer)
    assert (pld.prompt_lookup_min, pld.prompt_lookup_max) == (2, 3)
    assert isinstance(make_proposer("user"), UserProposer)
    suffix = make_proposer("suffix", suffix_decoding_max_tree_depth=8)
    assert isinstance(suffix, SuffixProposer) and suffix.max_tree_depth == 8


def test_make_proposer_unknown_method_lists_valid():
    """An unknown method raises ConfigError listing the valid ones."""
    with pytest.raises(ConfigError, match="'hydra'.*none, pld, user, suffix, draft, eagle, medusa"):
        make_proposer("hydra")


def test_draft_comes_from_the_registry_and_needs_its_package():
    """`draft` is a registry method like the others: without draft_package it names the knob and the fix."""
    with pytest.raises(ConfigError, match="method draft needs draft_package .*--num-layers"):
        make_proposer("draft", prompt_lookup_min=2)


def test_default_propose_batch_gives_point_mass_proposals():
    """propose_batch asks propose() per request, skips cap 0, and carries no q (drafts are point masses)."""
    proposer = PromptLookupProposer()
    proposer.start("a", [1, 2, 3, 1, 2])
    proposer.start("b", [1, 2, 3, 1, 2])
    a, b = proposer.propose_batch([("a", 2), ("b", 0)])
    assert a.tokens.tolist() == [3, 1] and a.probs is None  # [1, 2] occurred before, followed by 3, 1
    assert len(b) == 0
    assert a.cut(1).tokens.tolist() == [3]


def test_prompt_lookup_proposals_carry_the_matched_ngram_length():
    """match_len is the n of the n-gram the drafts continue (cost dispatch's acceptance class); 0 without drafts."""
    proposer = PromptLookupProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    proposer.start("tri", [5, 6, 7, 8, 5, 6, 7])  # [5, 6, 7] occurred before: a 3-gram match
    proposer.start("uni", [5, 6, 7, 8, 9, 7])  # only [7] occurred before
    proposer.start("none", [1, 2, 3])
    tri, uni, none = proposer.propose_batch([("tri", 4), ("uni", 4), ("none", 4)])
    assert (tri.tokens.tolist(), tri.match_len) == ([8, 5, 6, 7], 3)
    assert (uni.tokens.tolist(), uni.match_len) == ([8, 9, 7], 1)
    assert (len(none), none.match_len) == (0, 0)
    assert tri.cut(2).match_len == 3  # cutting drafts keeps the class


def test_make_proposer_bad_knobs():
    """Unknown knob names and invalid values raise ConfigError naming them."""
    with pytest.raises(ConfigError, match="prompt_lookup_mn"):
        make_proposer("pld", prompt_lookup_mn=2)
    with pytest.raises(ConfigError, match="prompt_lookup_min=0"):
        make_proposer("pld", prompt_lookup_min=0)
    with pytest.raises(ConfigError, match="prompt_lookup_max=1 < prompt_lookup_min=2"):
        make_proposer("pld", prompt_lookup_min=2, prompt_lookup_max=1)
    with pytest.raises(ConfigError, match="suffix_decoding_min_token_prob=1.5"):
        make_proposer("suffix", suffix_decoding_min_token_prob=1.5)
