"""Hidden-state proposers on a scripted head: which pairs each call writes, at which positions, and the chain."""

from __future__ import annotations

import numpy as np

from qspec import contract
from qspec.runtime.heads import EagleProposer, MedusaProposer, call_widths

VOCAB, HIDDEN = 32, 4


class ScriptedHead:
    """A head whose draft is ``(last real input token + 1) % VOCAB`` with probability ``probs[token]`` (default
    0.9), and whose feature out is the input feature + 1; it records every call."""

    batch_index = False

    def __init__(self, probs=None):
        self.calls = []
        self.probs = probs or {}

    def run(self, feeds, *, keep: int = 1):
        assert keep == 1  # a chained head's calls keep each row's last row (HeadGraph.run)
        ids, pos, hidden = feeds[contract.INPUT_IDS], feeds[contract.POSITION_IDS], feeds[contract.HIDDEN_STATES]
        self.calls.append((ids.copy(), pos.copy(), hidden.copy()))
        rows = ids.shape[0]
        logits = np.zeros((rows, 1, VOCAB), np.float32)
        out = np.zeros((rows, 1, HIDDEN), np.float32)
        for r in range(rows):
            last = int(np.flatnonzero(pos[r] >= 0)[-1])
            token = int(ids[r, last])
            p = self.probs.get(token, 0.9)
            logits[r, 0] = np.log((1 - p) / (VOCAB - 1))
            logits[r, 0, (token + 1) % VOCAB] = np.log(p)
            out[r, 0] = hidden[r, last] + 1
        return {contract.LOGITS: logits, contract.HIDDEN_STATES_OUT: out}


def eagle(head, threshold=0.5):
    return EagleProposer(head, None, ctx_len=64, hidden_size=HIDDEN, rows=1, threshold=threshold, widths=[1, 3, 8])


def features(start, n):
    return np.arange(start, start + n, dtype=np.float32)[:, None].repeat(HIDDEN, 1)  # f_t = t


def test_head_calls_pad_to_a_power_of_two_below_the_widest_compiled_width():
    """A head runs in ONNX Runtime at any width and costs about its width: a catch-up of 6 pairs pays for 8 of the
    compiled [1, 5, 64], not for 64; the compiled widths stay (a QAIC-shaped call is still one of them)."""
    assert call_widths([1, 5, 64]) == [1, 2, 4, 5, 8, 16, 32, 64]
    assert call_widths([1]) == [1] and call_widths([8, 1, 3]) == [1, 2, 3, 4, 8]


def test_eagle_catches_up_then_chains():
    """Prompt 0..4 and first token 5: one catch-up call writes pairs (f_t, x_{t+1}) at t = 0..4, then two
    chained one-token calls feed (f^, d_i) at positions 5 and 6; drafts 6, 7, 8."""
    head = ScriptedHead()
    proposer = eagle(head)
    proposer.start("a", [0, 1, 2, 3, 4])
    proposer.observe_hidden("a", 0, features(0, 5))
    proposer.extend("a", [5])
    assert proposer.propose("a", 3).tolist() == [6, 7, 8]
    ids, pos, hidden = head.calls[0]
    assert ids[0, :5].tolist() == [1, 2, 3, 4, 5] and pos[0].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]  # width 8
    assert hidden[0, :5, 0].tolist() == [0, 1, 2, 3, 4]
    assert [c[1][0].tolist() for c in head.calls[1:]] == [[5], [6]]  # chain positions
    assert [c[0][0].tolist() for c in head.calls[1:]] == [[6], [7]]  # chain tokens: the drafts
    assert head.calls[1][2][0, 0, 0] == 5.0  # f^_5 = f_4 + 1, the head's own feature


def test_eagle_catch_up_after_a_verify_overwrites_the_chain():
    """After accepting d_1 = 6 and a bonus 9, the next call writes (f_5, 6), (f_6, 9) at positions 5 and 6 (the
    chain's slots), with the target's features, and drafts from 9."""
    head = ScriptedHead()
    proposer = eagle(head)
    proposer.start("a", [0, 1, 2, 3, 4])
    proposer.observe_hidden("a", 0, features(0, 5))
    proposer.extend("a", [5])
    proposer.propose("a", 3)
    head.calls.clear()
    proposer.observe_hidden("a", 5, features(5, 2) * 10)
    proposer.extend("a", [6, 9])
    assert proposer.propose("a", 1).tolist() == [10]
    (ids, pos, hidden), *rest = head.calls
    assert ids[0, :2].tolist() == [6, 9] and pos[0].tolist() == [5, 6]  # width 2: the smallest call width that holds 2
    assert hidden[0, :2, 0].tolist() == [50.0, 60.0] and not rest  # cap 1: no chained call


def test_eagle_chain_stops_below_the_threshold():
    """A chained draft under the threshold ends the row: the first draft is kept whatever its confidence."""
    head = ScriptedHead(probs={5: 0.1, 6: 0.2})
    proposer = eagle(head)
    proposer.start("a", [0, 1, 2, 3, 4])
    proposer.observe_hidden("a", 0, features(0, 5))
    proposer.extend("a", [5])
    assert proposer.propose("a", 4).tolist() == [6]  # p(6) = 0.1 < 0.5: one draft, no chain call
    assert len(head.calls) == 1


def test_head_proposals_carry_the_first_drafts_probability():
    """EAGLE and Medusa proposals say how sure the head was of the first draft: cost dispatch keeps one
    acceptance estimate per tenth of it (Proposal.dispatch_class), apart from lookup's match lengths."""
    head = ScriptedHead(probs={5: 0.93, 6: 0.5})
    proposer = eagle(head, threshold=0.2)
    proposer.start("a", [0, 1, 2, 3, 4])
    proposer.observe_hidden("a", 0, features(0, 5))
    proposer.extend("a", [5])
    (proposal,) = proposer.propose_batch([("a", 3)])
    assert proposal.tokens.tolist() == [6, 7, 8] and abs(proposal.confidence - 0.93) < 1e-6
    assert proposal.dispatch_class == -10 and proposal.cut(1).dispatch_class == -10
    assert np.allclose(proposal.survival, [0.93, 0.465, 0.4185])
    assert np.allclose(proposal.cut(2).survival, [0.93, 0.465])

    medusa = MedusaProposer(
        ScriptedMedusa([0.35, 0.9, 0.8]), None, ctx_len=0, hidden_size=HIDDEN, rows=1, threshold=0.5
    )
    medusa.check_target(vocab_size=VOCAB, ctx_len=64, num_slots=1)
    medusa.start("b", [1, 2])
    medusa.observe_hidden("b", 0, features(0, 2))
    (proposal,) = medusa.propose_batch([("b", 3)])
    assert abs(proposal.confidence - 0.35) < 1e-6 and proposal.dispatch_class == -4
    assert np.allclose(proposal.survival, [0.35])


def test_eagle_long_prompt_catches_up_in_widest_chunks():
    """A 20-token prompt catches up in calls of the widest compiled shape (8): pairs 0..7, 8..15, 16..19."""
    head = ScriptedHead()
    proposer = eagle(head)
    prompt = list(range(20))
    proposer.start("a", prompt)
    proposer.observe_hidden("a", 0, features(0, 20))
    proposer.extend("a", [20])
    proposer.propose("a", 1)
    assert [c[1][0][c[1][0] >= 0].tolist() for c in head.calls] == [
        list(range(0, 8)),
        list(range(8, 16)),
        list(range(16, 20)),
    ]


class ScriptedMedusa:
    batch_index = False

    def __init__(self, probs):
        self.probs = probs
        self.seen = []

    def run(self, feeds):
        hidden = feeds[contract.HIDDEN_STATES]  # [rows, 1, hidden]
        self.seen.append(hidden.copy())
        logits = np.full((hidden.shape[0], len(self.probs), VOCAB), -10.0, np.float32)
        for k, p in enumerate(self.probs):
            logits[:, k, k + 1] = np.log(p / (1 - p) * (VOCAB - 1) * np.exp(-10.0))
        return {contract.LOGITS: logits}


def test_medusa_reads_the_newest_hidden_state_and_cuts_at_the_first_unsure_head():
    """Heads drafting 1, 2, 3 with probabilities 0.9, 0.6, 0.3 and threshold 0.5: drafts [1, 2] from f_4."""
    head = ScriptedMedusa([0.9, 0.6, 0.3])
    proposer = MedusaProposer(head, None, ctx_len=0, hidden_size=HIDDEN, rows=1, threshold=0.5)
    proposer.check_target(vocab_size=VOCAB, ctx_len=64, num_slots=1)
    proposer.start("a", [0, 1, 2, 3, 4])
    proposer.observe_hidden("a", 0, features(0, 5))
    proposer.extend("a", [5])
    assert proposer.propose("a", 3).tolist() == [1, 2]
    assert head.seen[0][0, 0, 0] == 4.0
    assert proposer.propose("a", 1).tolist() == [1]  # the cap cuts first


def test_lookup_first_takes_long_matches_and_the_head_elsewhere():
    """``eagle+pld``: history ``7 8 9 3 7 8 9`` continues a 3-gram (lookup drafts 3, 7, 8); ``0 1 2 3 4`` matches
    nothing long (the head drafts 6, 7 after first token 5), and the head catches up on the steps it skipped."""
    from qspec.runtime.lookup_first import LookupFirstProposer
    from qspec.runtime.proposers import PromptLookupProposer

    head = ScriptedHead()
    proposer = LookupFirstProposer(PromptLookupProposer(1, 3), eagle(head))
    proposer.start("rep", [7, 8, 9, 3, 7, 8])
    proposer.observe_hidden("rep", 0, features(0, 6))
    proposer.extend("rep", [9])
    proposer.start("open", [0, 1, 2, 3, 4])
    proposer.observe_hidden("open", 0, features(0, 5))
    proposer.extend("open", [5])
    rep, open_ = proposer.propose_batch([("rep", 3), ("open", 2)])
    assert rep.tokens.tolist() == [3, 7, 8] and rep.match_len == 3
    assert open_.tokens.tolist() == [6, 7] and open_.match_len == 0
    assert all(call[0].shape[0] == 1 for call in head.calls)  # the head ran for the open row only
    head.calls.clear()
    proposer.observe_hidden("rep", 6, features(6, 2))
    proposer.extend("rep", [3, 5])  # accepted 3, bonus 5: no long match now
    assert proposer.propose_batch([("rep", 1)])[0].tokens.tolist() == [6]
    assert head.calls[0][1][0][head.calls[0][1][0] >= 0].tolist() == list(range(8))  # pairs 0..7 at once


def test_eagle_asks_after_each_draft_whether_the_next_pays():
    """The engine's dispatch says, after each draft, how many drafts of a proposal like this one it would verify
    at what a further head call costs: the chain stops as soon as that is not more than it has (each chained draft
    is a head call); the proposal so far (with its survival), the cap and the sampling mode are what it is asked."""
    asked = []

    def useful(proposal, cap, greedy, draft_ms):
        asked.append((proposal.tokens.tolist(), np.round(proposal.survival, 4).tolist(), cap, greedy))
        return 2

    head = ScriptedHead(probs={5: 0.95})
    proposer = eagle(head)
    proposer.limit_depth(useful)
    proposer.start("a", [0, 1, 2, 3, 4])
    proposer.observe_hidden("a", 0, features(0, 5))
    proposer.extend("a", [5])
    assert proposer.propose("a", 4).tolist() == [6, 7]  # the threshold would let it chain to 4
    assert len(head.calls) == 2 and asked == [([6], [0.95], 4, True), ([6, 7], [0.95, 0.855], 4, True)]
    assert proposer.chain_ms > 0  # what the chained call cost, for the next question
    proposer.limit_depth(lambda proposal, cap, greedy, draft_ms: 0)
    head.calls.clear()
    proposer.observe_hidden("a", 5, features(5, 1))
    proposer.extend("a", [6])
    assert proposer.propose("a", 4).tolist() == [7]  # the first draft comes with the catch-up: always kept
    assert len(head.calls) == 1
