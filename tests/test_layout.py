"""The verify layout (qspec.runtime.layout): chains and trees of drafts, their positions, walk and KV moves."""

from __future__ import annotations

import numpy as np

from qspec.runtime.dispatch import Dispatcher
from qspec.runtime.layout import VerifyLayout
from qspec.runtime.proposal import Proposal
from qspec.runtime.proposers import PromptLookupProposer
from qspec.runtime.sampling import accept_greedy


def tree(tokens, parents) -> VerifyLayout:
    return VerifyLayout(np.asarray(tokens, np.int64), np.asarray(parents, np.int64))


def test_a_chain_is_the_layout_whose_parents_are_the_drafts_before():
    chain = VerifyLayout.chain(np.array([5, 6, 7]))
    assert chain.parent_ids.tolist() == [-1, 0, 1] and chain.is_chain and chain.chain_len == 3
    assert chain.positions(10).tolist() == [10, 11, 12, 13]
    assert chain.moves([0, 1, 2]) == []


def test_siblings_share_a_position_and_follow_the_chain():
    layout = tree([5, 6, 8], [-1, 0, -1])  # chain 5 6, 8 the runner-up of 5
    assert not layout.is_chain and layout.chain_len == 2
    assert layout.depths.tolist() == [1, 2, 1]
    assert layout.positions(10).tolist() == [10, 11, 12, 11]
    assert layout.cut(2).is_chain and len(layout.cut(1)) == 1


def test_the_greedy_walk_takes_the_child_the_target_picks():
    layout = tree([5, 6, 8], [-1, 0, -1])
    assert layout.walk_greedy(np.array([5, 6, 4, 0])) == ([0, 1], 4)  # the chain, then the bonus after 6
    assert layout.walk_greedy(np.array([8, 1, 2, 3])) == ([2], 3)  # the sibling; the bonus is its row's argmax
    assert layout.walk_greedy(np.array([7, 1, 2, 3])) == ([], 7)  # neither
    assert layout.rows([2]) == [0, 3] and layout.moves([2]) == [(3, 1)]  # its KV from slot p+3 to p+1
    assert layout.moves([0, 1]) == []


def test_accept_greedy_is_the_walk_of_a_chain():
    assert accept_greedy(np.array([5, 6, 9, 4]), np.array([5, 6, 7])) == (2, 9)
    assert accept_greedy(np.array([5, 6, 7, 4]), np.array([5, 6, 7])) == (3, 4)


def test_a_tree_proposal_cuts_to_its_chain_and_prices_its_sibling_below_the_first_draft():
    proposal = Proposal(np.array([5, 6, 8]), survival=np.array([0.6, 0.4, 0.3]), parents=np.array([-1, 0, -1]))
    assert proposal.layout.chain_len == 2 and proposal.chain_only().parents is None
    assert len(proposal.chain_only()) == 2 and proposal.cut(2).parents is None
    dispatcher = Dispatcher([0, 2, 4], mode="cover")
    gains = dispatcher.chain(proposal)
    assert len(gains) == 3 and gains[2] <= gains[1] <= gains[0]
    dispatcher.observe_row(0, proposal, [2])  # the sibling passed: the first draft failed
    dispatcher.observe_row(0, proposal, [0, 1])
    assert (dispatcher.siblings.offered, dispatcher.siblings.tried, dispatcher.siblings.passed) == (2, 1, 1)


class TreeLookup(PromptLookupProposer):
    """Prompt lookup's chain plus a sibling of its first draft (token 1 + the first draft): a tree proposal."""

    def proposal(self, request_id, k: int) -> Proposal:
        chain = super().proposal(request_id, max(k - 1, 1))
        if not len(chain):
            return chain
        tokens = np.concatenate([chain.tokens, [int(chain.tokens[0]) + 1]])
        parents = np.concatenate([np.arange(len(chain)) - 1, [-1]])
        return Proposal(tokens, match_len=chain.match_len, parents=parents)


def test_a_tree_proposal_on_a_graph_that_verifies_chains_runs_its_chain(tiny_model, tmp_path):
    """A runtime graph with several KV slots verifies chains only (verifies_trees false): a tree is cut to its
    top-1 chain before dispatch, no sibling is offered, and greedy output is `none`'s."""
    from qspec.runtime import Engine, SamplingParams
    from tests.test_runtime import PROMPTS, compile_tiny

    package = compile_tiny(tiny_model("llama"), tmp_path / "pkg", "0,4", fbs=2)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in Engine(package, method="none").generate(PROMPTS[:3], params)]
    engine = Engine(package, proposer=TreeLookup(), dispatch="cover")
    assert not engine.model.verifies_trees
    assert [o.token_ids for o in engine.generate(PROMPTS[:3], params)] == plain
    assert engine.last_metrics.accepted > 0 and engine.dispatcher.siblings.offered == 0


def test_a_tree_written_as_parents_that_happen_to_chain_acts_as_the_chain():
    chain = VerifyLayout.chain(np.array([5, 6, 7]))
    spelled = tree([5, 6, 7], [-1, 0, 1])
    argmax = np.array([5, 6, 9, 4])
    assert spelled.is_chain and spelled.walk_greedy(argmax) == chain.walk_greedy(argmax) == ([0, 1], 9)
    assert spelled.positions(3).tolist() == chain.positions(3).tolist() and spelled.moves([0, 1]) == []
