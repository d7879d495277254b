"""Suffix decoding: the depth-bounded suffix trie and SuffixProposer."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from qspec.errors import ConfigError
from qspec.runtime.suffix import SuffixProposer, SuffixTrie


def proposer_with(prompt, **knobs) -> SuffixProposer:
    proposer = SuffixProposer(**knobs)
    proposer.start("r", prompt)
    return proposer


def propose(prompt, k, **knobs) -> list[int]:
    return proposer_with(prompt, **knobs).propose("r", k).tolist()


def finished(proposer: SuffixProposer, request_id, prompt, output) -> None:
    proposer.start(request_id, prompt)
    proposer.extend(request_id, output)
    proposer.finish(request_id)


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every substring the trie holds, with its count."""
    counts: dict[tuple[int, ...], int] = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in (node.children or {}).items():
            counts[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return counts


def brute_counts(sequences, depth) -> dict[tuple[int, ...], int]:
    """Occurrences of every substring of at most ``depth`` tokens, counted by brute force."""
    counts: Counter = Counter()
    for seq in sequences:
        for end in range(len(seq)):
            for n in range(1, min(depth, end + 1) + 1):
                counts[tuple(seq[end - n + 1 : end + 1])] += 1
    return dict(counts)


# --------------------------------------------------------------------------------------------
# SuffixTrie
# --------------------------------------------------------------------------------------------


def test_trie_counts_match_brute_force_with_removal():
    """Adding and removing random sequences leaves exactly the brute-force substring counts."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        depth = int(rng.integers(1, 6))
        trie = SuffixTrie(depth)
        sequences = [rng.integers(0, 3, size=int(rng.integers(1, 15))).tolist() for _ in range(4)]
        for seq in sequences:
            frontier = trie.frontier()
            for i in range(0, len(seq), 3):  # in chunks: the frontier carries over
                frontier = trie.add(frontier, seq[i : i + 3])
        assert trie_counts(trie) == brute_counts(sequences, depth)
        trie.remove(sequences[1])
        trie.remove(sequences[3])
        assert trie_counts(trie) == brute_counts([sequences[0], sequences[2]], depth)
        assert trie.root.count == len(sequences[0]) + len(sequences[2])


def test_trie_best_child_after_removal():
    """The most frequent child is tracked through additions and removals (ties -> lowest id)."""
    trie = SuffixTrie(2)
    trie.add(trie.frontier(), [1, 5, 1, 5, 1, 4])  # after 1: 5 twice, 4 once
    node = trie.root.children[1]
    assert node.best_child() == 5
    trie.remove([1, 5])  # after 1: 5 once, 4 once
    assert node.best_child() == 4  # tie -> lowest id
    trie.remove([1, 5, 1, 4])
    assert 1 not in trie.root.children  # count 0: the node is gone


def test_trie_follow_does_not_count():
    """follow() walks the longest present suffixes without changing counts."""
    trie = SuffixTrie(4)
    trie.add(trie.frontier(), [1, 2, 3])
    before = trie_counts(trie)
    frontier = trie.follow(trie.frontier(), [9, 1, 2])
    assert len(frontier) == 3  # [2] and [1, 2] are present, [9, 1, 2] is not
    assert trie_counts(trie) == before


# --------------------------------------------------------------------------------------------
# SuffixProposer: request tree
# --------------------------------------------------------------------------------------------


def test_docstring_example():
    """[1, 2, 3, 1, 2]: the match [1, 2] allows two tokens, [3, 1]."""
    assert propose([1, 2, 3, 1, 2], k=4) == [3, 1]
    assert propose([1, 2, 3, 1, 2], k=1) == [3]


def test_spec_length_follows_match_length():
    """The draft is at most max_spec_factor * match_length tokens (and at most k)."""
    prompt = [1, 2, 3, 4, 5, 1, 2]  # match [1, 2]: length 2
    assert propose(prompt, k=5) == [3, 4]
    assert propose(prompt, k=5, suffix_decoding_max_spec_factor=2.0) == [3, 4, 5, 1]
    assert propose(prompt, k=3, suffix_decoding_max_spec_factor=2.0) == [3, 4, 5]


def test_proposals_carry_the_match_length():
    """match_len is the length of the suffix match the draft continues (0 when there is no draft)."""
    proposer = SuffixProposer()
    proposer.start("a", [1, 2, 3, 4, 5, 1, 2])  # match [1, 2]
    proposer.start("b", [1, 2, 3])
    a, b = proposer.propose_batch([("a", 5), ("b", 5)])
    assert (a.tokens.tolist(), a.match_len) == ([3, 4], 2)
    assert (len(b), b.match_len) == (0, 0)


def test_min_token_prob_stops_the_walk():
    """The walk stops when the running probability drops below min_token_prob."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 4, 7]
    # after [7]: 8 (3 of 3, the last 7 not counted) -> p 1; after [7, 8]: 9 (2 of 3) -> p 2/3;
    # after [7, 8, 9]: 7 (2 of 2) -> 2/3; after [7, 8, 9, 7]: 8 (2 of 2) -> 2/3
    knobs = dict(suffix_decoding_max_spec_factor=4.0)
    assert propose(prompt, k=4, **knobs) == [8, 9, 7, 8]
    assert propose(prompt, k=4, suffix_decoding_min_token_prob=0.7, **knobs) == [8]


def test_min_token_prob_on_first_token():
    """A first token below min_token_prob gives no draft; ties between children go to the lowest id."""
    prompt = [5, 1, 5, 2, 5, 3, 5]  # after 5: 1, 2 or 3, one third each
    assert propose(prompt, k=3) == [1]
    assert propose(prompt, k=3, suffix_decoding_min_token_prob=0.5) == []


def test_depth_bound_limits_match_and_continuation():
    """In a tree of depth 3, a 3-token match has no room to continue."""
    prompt = [1, 2, 3, 4, 1, 2, 3]
    assert propose(prompt, k=3) == [4, 1, 2]  # match [1, 2, 3]
    assert propose(prompt, k=3, suffix_decoding_max_tree_depth=3) == [4]  # [2, 3] -> 4, then a leaf


def test_nothing_to_propose():
    """A history without a recurring suffix, or k = 0, gives an empty int64 array."""
    draft = propose([1, 2, 3], k=4)
    assert draft == [] and proposer_with([1, 2, 3]).propose("r", 4).dtype == np.int64
    assert propose([1, 2, 1], k=0) == []
    assert propose([], k=3) == []


def test_extend_in_steps_equals_start_with_everything():
    """Growing a history step by step proposes what starting with the whole history does."""
    rng = np.random.default_rng(1)
    for _ in range(40):
        tokens = rng.integers(0, 4, size=int(rng.integers(2, 40))).tolist()
        split = int(rng.integers(1, len(tokens)))
        grown = proposer_with(tokens[:split], suffix_decoding_max_tree_depth=6)
        for i in range(split, len(tokens), 2):
            grown.extend("r", tokens[i : i + 2])
        whole = proposer_with(tokens, suffix_decoding_max_tree_depth=6)
        for k in (1, 3, 8):
            assert grown.propose("r", k).tolist() == whole.propose("r", k).tolist(), (tokens, split, k)


# --------------------------------------------------------------------------------------------
# SuffixProposer: global tree
# --------------------------------------------------------------------------------------------


def test_global_tree_learns_finished_outputs():
    """A finished request's output (not its prompt) feeds later requests' drafts."""
    proposer = SuffixProposer()
    finished(proposer, "a", prompt=[1], output=[7, 8, 9, 10])
    proposer.start("b", [5, 7, 8])  # [7, 8] never recurs locally; the global tree knows it
    assert proposer.propose("b", 4).tolist() == [9, 10]
    assert proposer.propose("b", 1).tolist() == [9]

    proposer = SuffixProposer()
    finished(proposer, "a", prompt=[7, 8, 9, 10], output=[1])
    proposer.start("b", [5, 7, 8])
    assert proposer.propose("b", 4).tolist() == []  # prompts are not cached


def test_global_tree_change_reaches_running_requests():
    """A request started before another finished sees the updated global tree."""
    proposer = SuffixProposer()
    proposer.start("b", [5, 7])
    assert proposer.propose("b", 4).tolist() == []
    finished(proposer, "a", prompt=[1], output=[7, 8, 9, 10])
    proposer.extend("b", [8])  # history [5, 7, 8]
    assert proposer.propose("b", 4).tolist() == [9, 10]
    proposer.extend("b", [9])  # the frontier into the global tree follows: [7, 8, 9] -> 10
    assert proposer.propose("b", 4).tolist() == [10]


def test_global_tree_evicts_oldest_output():
    """Beyond max_cached_requests, the least recently added output is forgotten."""
    for cap, expected in ((1, []), (2, [9, 10]), (0, [])):
        proposer = SuffixProposer(suffix_decoding_max_cached_requests=cap)
        finished(proposer, "a", prompt=[1], output=[7, 8, 9, 10])
        finished(proposer, "c", prompt=[1], output=[3, 4])
        proposer.start("b", [7, 8])
        assert proposer.propose("b", 4).tolist() == expected, cap


def test_better_score_wins_between_trees():
    """The request tree's draft wins when it scores higher than the global tree's."""
    proposer = SuffixProposer()
    finished(proposer, "a", prompt=[1], output=[7, 8, 9])
    proposer.start("b", [7, 8, 1, 2, 3, 7, 8])  # local: [1, 2], score 2; global: [9], score 1
    assert proposer.propose("b", 4).tolist() == [1, 2]


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_bad_knobs_name_values():
    """Invalid knobs raise ConfigError naming the value."""
    with pytest.raises(ConfigError, match="suffix_decoding_max_tree_depth=0"):
        SuffixProposer(suffix_decoding_max_tree_depth=0)
    with pytest.raises(ConfigError, match="suffix_decoding_max_cached_requests=-1"):
        SuffixProposer(suffix_decoding_max_cached_requests=-1)
    with pytest.raises(ConfigError, match="suffix_decoding_max_spec_factor=0"):
        SuffixProposer(suffix_decoding_max_spec_factor=0)
    with pytest.raises(ConfigError, match="suffix_decoding_min_token_prob=-0.1"):
        SuffixProposer(suffix_decoding_min_token_prob=-0.1)


def test_unknown_request():
    """Using a request that was not started raises KeyError telling to call start()."""
    with pytest.raises(KeyError, match="start"):
        SuffixProposer().propose("nope", 2)


def test_running_request_equals_fresh_start_randomized():
    """Outputs finishing while a request runs give the drafts of a request started afterwards."""
    rng = np.random.default_rng(2)
    for _ in range(30):
        knobs = dict(suffix_decoding_max_tree_depth=5, suffix_decoding_max_cached_requests=2)
        outputs = [rng.integers(0, 4, size=int(rng.integers(1, 12))).tolist() for _ in range(3)]
        history = rng.integers(0, 4, size=20).tolist()
        running, fresh = SuffixProposer(**knobs), SuffixProposer(**knobs)
        running.start("b", history[:4])
        for i, output in enumerate(outputs):
            running.propose("b", 3)  # caches a frontier into the global tree, soon stale
            finished(running, i, prompt=[0], output=output)
            finished(fresh, i, prompt=[0], output=output)
            running.extend("b", history[4 + 4 * i : 8 + 4 * i])
        running.extend("b", history[16:])
        fresh.start("b", history)
        for k in (1, 3, 6):
            assert running.propose("b", k).tolist() == fresh.propose("b", k).tolist(), (outputs, history)
