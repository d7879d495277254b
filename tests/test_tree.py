"""Tree verification on the runtime graph: a verify row ``[last, chain..., siblings...]`` (qspec.runtime.layout)
gives every token the logits it gets in a plain chain call, bit for bit, and an accepted sibling's KV moved to
its depth's slot continues exactly as if it had been verified alone; greedy output with tree proposals is
`none`'s. Tiny random Llama, fp32 and int4, one KV slot and two rows a call (the host's call plan; a
continuous-batching graph verifies chains)."""

from __future__ import annotations

import numpy as np
import pytest

from qspec.runtime.layout import VerifyLayout
from qspec.runtime.proposal import Proposal, Proposer
from tests.test_runtime import PROMPTS
from tests.test_weight_formats import compile_format

P = 6  # prompt tokens in the cache before the verify calls


@pytest.fixture(scope="module")
def packages(tiny_model, tmp_path_factory):
    """``packages[(fmt, 1)]``: K 0,4 packages with one KV slot."""
    root = tmp_path_factory.mktemp("tree")
    model = tiny_model("llama")
    made = {}
    for fmt in ("fp32", "int4"):
        for slots in (1,):
            fbs = slots if slots > 1 else None
            made[(fmt, slots)] = compile_format(model, root / f"{fmt}-{slots}", "0,4", fmt, fbs=fbs)[0]
    return made


def prefilled(package):
    from qspec.runtime.model import CompiledModel

    model = CompiledModel(package)
    assert model.verifies_trees
    for row in range(model.rows):  # every KV row holds a prompt (rows differ: the tree row is not row 0 alone)
        prefill = model.prefill
        prefill.reset()
        prefill.input_ids[0, :P] = PROMPTS[3 - row][:P]
        prefill.position_ids[0, :P] = np.arange(P)
        if prefill.batch_index is not None:
            prefill.batch_index[0, 0] = row
        model.run(prefill)
    return model


def call(model, k: int, rows: dict[int, tuple[list[int], np.ndarray]]) -> dict[int, np.ndarray]:
    """One decode call of K: KV row -> (tokens, positions); returns each row's logits of its tokens."""
    bound = model.decode[k]
    bound.reset()
    for i, (slot, (tokens, positions)) in enumerate(sorted(rows.items())):
        row = slot if bound.batch_index is None else i
        if bound.batch_index is not None:
            bound.batch_index[i, 0] = slot
        bound.input_ids[row, : len(tokens)] = tokens
        bound.position_ids[row, : len(tokens)] = positions
    logits = model.run(bound)
    keep = logits.shape[1]
    out = {}
    for i, (slot, (tokens, _)) in enumerate(sorted(rows.items())):
        row = slot if bound.batch_index is None else i
        out[slot] = logits[row, keep - len(tokens) :].copy()
    return out


@pytest.mark.parametrize("slots", [1])
@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_a_tree_row_gives_each_token_its_chain_call_logits(packages, fmt, slots):
    """``[last, a, b, c]`` with ``c`` beside ``a`` (positions p, p+1, p+2, p+1): ``last``, ``a``, ``b`` get the
    logits of the chain call ``[last, a, b]``, ``c`` those of ``[last, c]``: its RoPE position is its depth's and
    it sees neither ``a`` nor ``b`` (a wrong bias or position changes them)."""
    model = prefilled(packages[(fmt, slots)])
    last, a, b, c = 50, 51, 52, 60
    tree = VerifyLayout(np.array([a, b, c]), np.array([-1, 0, -1]))
    slot = slots - 1  # with two slots the tree is on KV row 1, row 0 verifies a chain beside it
    beside = {0: ([70, 71], np.array([P, P + 1]))} if slots > 1 else {}
    in_tree = call(model, 4, beside | {slot: ([last, *tree.tokens], tree.positions(P))})[slot]
    chain = call(model, 4, beside | {slot: ([last, a, b], np.arange(P, P + 3))})[slot]
    sibling = call(model, 4, beside | {slot: ([last, c], np.arange(P, P + 2))})[slot]
    np.testing.assert_array_equal(in_tree[:3], chain)
    np.testing.assert_array_equal(in_tree[3], sibling[1])
    assert not np.array_equal(in_tree[3], in_tree[1])


@pytest.mark.parametrize("slots", [1])
@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_an_accepted_sibling_continues_as_if_verified_alone_once_its_kv_moves(packages, fmt, slots):
    """The sibling ``c`` wins: its KV moves from slot p+3 to p+1 (``move_kv``); the next token's logits equal
    those after a plain ``[last, c]`` call, and differ without the move (the test fails if the KV stays)."""
    model = prefilled(packages[(fmt, slots)])
    slot = slots - 1
    last, a, b, c, following = 50, 51, 52, 60, 61
    tree = VerifyLayout(np.array([a, b, c]), np.array([-1, 0, -1]))
    call(model, 4, {slot: ([last, c], np.arange(P, P + 2))})
    expected = call(model, 0, {slot: ([following], np.array([P + 2]))})[slot]

    call(model, 4, {slot: ([last, *tree.tokens], tree.positions(P))})
    stale = call(model, 0, {slot: ([following], np.array([P + 2]))})[slot]  # c's KV not moved: a's at p+1
    assert not np.array_equal(stale, expected)
    call(model, 4, {slot: ([last, *tree.tokens], tree.positions(P))})
    path, _ = tree.walk_greedy(np.array([c, 0, 0, 0]))
    written = model.written_slots(tree.positions(P).tolist())
    assert written == [0, 1, 2, 1 + model.lanes]  # the sibling a lane group past its depth's slot
    model.move_kv(slot, [(P + src, P + dst) for src, dst in tree.moves(path, written)])
    moved = call(model, 0, {slot: ([following], np.array([P + 2]))})[slot]
    np.testing.assert_array_equal(moved, expected)


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_greedy_output_with_tree_proposals_is_plain_greedy(packages, fmt):
    """Prompt lookup's chain plus a sibling of its first draft, verified as trees (siblings accepted, their KV
    moved): the output equals `none`, token for token."""
    from qspec.runtime import Engine, SamplingParams

    package = packages[(fmt, 1)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in Engine(package, method="none").generate(PROMPTS, params)]
    engine = Engine(package, proposer=OracleTree(plain), dispatch="cover")
    assert engine.model.verifies_trees
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == plain
    siblings = engine.dispatcher.siblings
    assert siblings.passed > 5 and engine.last_metrics.accepted > siblings.passed  # siblings and chains accepted


class OracleTree(Proposer):
    """Trees around the known output: on odd steps a wrong first draft with the right token as its sibling (the
    walk takes the sibling: its KV must move), on even steps the right two tokens as the chain and a wrong
    sibling. ``expected[i]``: request ``i``'s plain greedy output."""

    def __init__(self, expected: list[list[int]]):
        self.expected, self.emitted, self.steps = expected, {}, {}

    def start(self, request_id, prompt_tokens, params=None, rng=None) -> None:
        self.emitted[request_id], self.steps[request_id] = 0, 0

    def extend(self, request_id, new_tokens) -> None:
        self.emitted[request_id] += len(new_tokens)

    def finish(self, request_id) -> None:
        self.emitted.pop(request_id, None)

    def propose(self, request_id, k: int) -> np.ndarray:
        return self.proposal(request_id, k).tokens

    def proposal(self, request_id, k: int) -> Proposal:
        truth = self.expected[request_id][self.emitted[request_id] :]
        self.steps[request_id] += 1
        if k < 3 or len(truth) < 2:
            return Proposal.empty()
        wrong = (truth[0] + 7) % 256 + 3
        if self.steps[request_id] % 2:
            tokens, parents = [wrong, truth[1], truth[0]], [-1, 0, -1]
        else:
            tokens, parents = [truth[0], truth[1], wrong], [-1, 0, -1]
        return Proposal(np.array(tokens, np.int64), parents=np.array(parents, np.int64))


@pytest.fixture(scope="module")
def eagle_packages(tiny_model, tmp_path_factory):
    """``eagle_packages[fmt]``: K 0,1,2,4, one KV slot, a random EAGLE-1 head (tests/test_bench_heads)."""
    from qspec.compile import CompileOptions, compile_package
    from qspec.specializations import make_config
    from tests.test_bench_heads import save_head

    root = tmp_path_factory.mktemp("tree-eagle")
    head = save_head(tiny_model("llama"), root / "head", "eagle")
    made = {}
    for fmt in ("fp32", "int4"):
        spec = make_config(num_speculative_tokens="0,1,2,4", prefill_seq_len=8, ctx_len=64)
        options = CompileOptions(specialization=spec, weight_format=fmt, draft_head=str(head))
        made[fmt] = compile_package(tiny_model("llama"), options, output=root / fmt)[0]
    return made


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_an_eagle_head_with_tree_width_2_drafts_trees_and_keeps_greedy_output(eagle_packages, fmt):
    """``tree_width=2``: the head's runner-up for the first draft rides beside the chain in the verify call; the
    output equals `none`'s."""
    from qspec.runtime import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    package = eagle_packages[fmt]
    plain = [o.token_ids for o in Engine(package, method="none").generate(PROMPTS, params)]
    engine = Engine(package, method="eagle", tree_width=2, dispatch="cover", draft_confidence_threshold=0.0)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == plain
    assert engine.dispatcher.siblings.offered > 0 and engine.proposer.tree_width == 2


def test_trees_on_two_rows_of_one_call_keep_greedy_output(tiny_model, tmp_path):
    """A batch-2 package without continuous batching (two rows a call, the host's plan per row): rows verify trees
    side by side, siblings accepted, and the output is `none`'s."""
    from qspec.compile import CompileOptions, compile_package
    from qspec.runtime import Engine, SamplingParams
    from qspec.specializations import make_config

    spec = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=64, batch_size=2)
    package = compile_package(tiny_model("llama"), CompileOptions(specialization=spec), output=tmp_path / "b2")[0]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in Engine(package, method="none").generate(PROMPTS, params)]
    engine = Engine(package, proposer=OracleTree(plain), dispatch="cover")
    assert engine.model.verifies_trees and engine.num_slots == 2
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == plain
    assert engine.dispatcher.siblings.passed > 5


def test_tree_width_is_a_draft_heads_option():
    """generate, chat and serve take --tree-width for a head's methods (aliases too); for a chain drafter it is a
    one-line error, not a silently ignored knob."""
    from qspec_cli.serve import method_options

    from qspec.errors import ConfigError
    from qspec.runtime.config import EngineConfig

    assert EngineConfig.create(method="eagle3+pld", tree_width=2).proposer_knobs() == {"tree_width": 2}
    with pytest.raises(ConfigError, match="tree_width 2 is for a draft head's method .* pld drafts chains"):
        EngineConfig.create(method="pld", tree_width=2)
    lookup = {"prompt_lookup_min": 1, "prompt_lookup_max": 3, "draft_package": None}
    assert method_options("eagle", **lookup, tree_width=2)["tree_width"] == 2
    with pytest.raises(ConfigError, match="--tree-width 2 is for a draft head's method"):
        method_options("suffix", **lookup, tree_width=2)
