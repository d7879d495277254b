"""Trees on the vendor graph (backend qaic): ``write_slots``, ``tree_mask`` and ``kv_moves`` inputs, run in the stand-in
QAIC session (tests/fake_qaic_runtime, ONNX Runtime's math). A tree row gives each token its chain call's logits, an
accepted sibling's KV is copied to its depth's slot by the next call, and greedy output with trees is `none`'s, on one
and two rows a call. Tiny random Llama, fp32 (the vendor graph has no int4: qaic-compile takes fp32 weights)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from qspec import contract
from qspec.compile import CompileOptions, compile_package
from qspec.errors import ConfigError
from qspec.runtime import Engine, SamplingParams
from qspec.runtime.layout import VerifyLayout
from qspec.runtime.load import load_model
from qspec.runtime.tree_inputs import tree_arrays, write_tree_inputs
from qspec.specializations import make_config
from tests.test_qaic_runtime import TESTS, qaic_runtime  # noqa: F401  (the stand-in QEfficient on sys.path)
from tests.test_runtime import PROMPTS
from tests.test_tree import OracleTree, P, call

COMPILER = TESTS / "fake_qaic" / "qaic-compile"


@pytest.fixture(scope="module")
def packages(tiny_model, tmp_path_factory):
    """Compiled for qaic by the stand-in compiler with ``--tree-inputs``: ``b1`` K 0,4 one row; ``b2`` K 0,4 two rows a
    call; ``cb`` K 0,4 continuous batching, 2 rows a call over 3 KV slots (``batch_index``: a row's copies go to its
    slot); and without: ``k0`` K 0, ``chain`` K 0,4 (the chain-only vendor graph)."""
    root = tmp_path_factory.mktemp("qaic-tree")
    built = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QAIC_COMPILE", str(COMPILER))
        for name, ks, batch, fbs, slots, trees in (
            ("b1", "0,4", 1, None, None, True),
            ("b2", "0,4", 2, None, None, True),
            ("cb", "0,4", 1, 2, 3, True),
            ("k0", "0", 1, None, None, False),
            ("chain", "0,4", 1, None, None, False),
        ):
            spec = make_config(
                num_speculative_tokens=ks,
                ctx_len=64,
                prefill_seq_len=8,
                batch_size=batch,
                full_batch_size=fbs,
                kv_cache_batch_size=slots,
            )
            options = CompileOptions.create(specialization=spec, backend="qaic", tree_inputs=trees)
            built[name], manifest, _ = compile_package(tiny_model("llama"), options, output=root / name)
            assert manifest.qaic.ran and manifest.model.tree_inputs == trees
    return built


def inputs(package) -> dict[str, list]:
    proto = onnx.load(str(package / "model.onnx"), load_external_data=False)
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in proto.graph.input}


def test_the_vendor_graph_takes_the_tree_inputs_on_the_specializations_own_symbols(packages, qaic_runtime):  # noqa: F811
    """K > 0: ``write_slots`` [batch_size, seq_len], ``tree_mask`` [batch_size, seq_len, seq_len], ``kv_moves``
    [batch_size, seq_len, 2], so specializations.json, custom_io.yaml and the command are a chain-only package's
    (QEfficient's sampler inputs follow the same rule); K 0 only, or without --tree-inputs: no tree inputs, and the
    session verifies chains."""
    dims = inputs(packages["b1"])
    assert dims[contract.WRITE_SLOTS] == ["batch_size", "seq_len"]
    assert dims[contract.TREE_MASK] == ["batch_size", "seq_len", "seq_len"]
    assert dims[contract.KV_MOVES] == ["batch_size", "seq_len", 2]
    assert not set(contract.TREE_INPUTS) & set(inputs(packages["k0"]))
    assert not set(contract.TREE_INPUTS) & set(inputs(packages["chain"]))
    assert load_model(packages["b1"], backend="qaic").verifies_trees
    assert not load_model(packages["chain"], backend="qaic").verifies_trees
    for name in ("specializations.json", "custom_io.yaml"):
        assert (packages["b1"] / name).read_text() == (packages["chain"] / name).read_text()
    custom_io = (packages["b1"] / "custom_io.yaml").read_text()
    assert not any(name in custom_io for name in contract.TREE_INPUTS)  # integers and booleans keep their type
    specs = json.loads((packages["b1"] / "specializations.json").read_text())["specializations"]
    assert [set(s) for s in specs] == [{"batch_size", "seq_len", "ctx_len", "num_logits_to_keep"}] * 3


@pytest.mark.parametrize(
    ("ks", "backend", "message"),
    [
        ("0,4", "ort", "tree_inputs are the vendor graph's .* drop --tree-inputs"),
        ("0", "qaic", "tree_inputs need a decode shape with drafts"),
    ],
)
def test_tree_inputs_are_refused_where_they_mean_nothing(ks, backend, message):
    """--tree-inputs without a vendor graph (the ort runtime graph verifies trees anyway) or without a K > 0 is a
    one-line error naming the fix."""
    spec = make_config(num_speculative_tokens=ks, ctx_len=64, prefill_seq_len=8)
    with pytest.raises(ConfigError, match=message):
        CompileOptions.create(specialization=spec, backend=backend, tree_inputs=True)


def test_the_stand_in_compiler_refuses_a_specialization_without_a_symbol_of_an_input(packages, tmp_path):
    """The stand-in checks what qaic-compile needs of the new inputs: each of their dimensions has a value in every
    specialization. Without ``seq_len`` in one entry it names the first input that needs it."""
    specs = json.loads((packages["b1"] / "specializations.json").read_text())
    del specs["specializations"][2]["seq_len"]
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    argv = [f"-m={packages['b1'] / 'model.onnx'}", f"-network-specialization-config={tmp_path / 'specs.json'}"]
    argv += ["-retained-state", f"-aic-binary-dir={tmp_path / 'qpc'}"]
    run = subprocess.run([sys.executable, str(COMPILER), *argv], capture_output=True, text=True)
    assert run.returncode == 1 and "specialization 2 gives no value for seq_len, a dimension of input input_ids" in (
        run.stderr
    )


def test_tree_inputs_from_positions():
    """A chain writes at its positions and sees the lower triangle; a tree ``[10, 11, 12, 11]`` writes at 10..13,
    and its sibling (token 3) sees ``last`` and itself only."""
    arrays = tree_arrays(2, 5)
    write_tree_inputs(np.array([[10, 11, 12, 11, -1], [4, 5, -1, -1, -1]]), arrays)
    assert arrays[contract.WRITE_SLOTS].tolist() == [[10, 11, 12, 13, 0], [4, 5, 0, 0, 0]]
    mask = arrays[contract.TREE_MASK]
    assert np.flatnonzero(mask[0, 3]).tolist() == [0, 3] and np.flatnonzero(mask[0, 2]).tolist() == [0, 1, 2]
    np.testing.assert_array_equal(mask[1], np.tril(np.ones((5, 5), bool)))


def prefilled(package):
    """The package on the QAIC session, every KV row holding a prompt of ``P`` tokens (rows differ)."""
    model = load_model(package, backend="qaic")
    assert model.verifies_trees
    prefill = model.prefill
    for slot in range(model.rows):
        prefill.reset()
        row = 0 if prefill.batch_index is not None else slot
        if prefill.batch_index is not None:
            prefill.batch_index[0, 0] = slot
        prefill.input_ids[row, :P] = PROMPTS[3 - slot][:P]
        prefill.position_ids[row, :P] = np.arange(P)
        model.run(prefill)
    return model


TREE = VerifyLayout(np.array([51, 52, 60]), np.array([-1, 0, -1]))  # chain 51 52, 60 beside 51; `last` is 50


@pytest.mark.usefixtures("qaic_runtime")
def test_a_tree_row_on_the_vendor_graph_gives_each_token_its_chain_logits(packages):
    """``[last, a, b, c]``, ``c`` beside ``a``: ``last``, ``a``, ``b`` get the chain call's logits bit for bit; ``c``
    those of ``[last, c]`` up to the softmax's summation order (its key sits two slots further: < 1e-5), far from
    ``a``'s (a wrong mask or slot changes them by units)."""
    model = prefilled(packages["b1"])
    in_tree = call(model, 4, {0: ([50, *TREE.tokens], TREE.positions(P))})[0]
    chain = call(model, 4, {0: ([50, 51, 52], np.arange(P, P + 3))})[0]
    sibling = call(model, 4, {0: ([50, 60], np.arange(P, P + 2))})[0]
    np.testing.assert_array_equal(in_tree[:3], chain)
    np.testing.assert_allclose(in_tree[3], sibling[1], atol=1e-5)
    assert np.abs(in_tree[3] - in_tree[1]).max() > 0.1


@pytest.mark.usefixtures("qaic_runtime")
@pytest.mark.parametrize(("name", "slot"), [("b1", 0), ("cb", 2)])
def test_an_accepted_siblings_kv_is_copied_on_the_device_by_the_next_call(packages, name, slot):
    """The sibling wins: ``move_kv`` (slot p+3 to p+1) is made by the next call's ``kv_moves``; the next token's
    logits are those after a plain ``[last, c]`` call, and not without the copy. With continuous batching the row
    runs KV slot 2 on call row 0 (``batch_index``): the copy goes to the KV row, not the call row."""
    model = prefilled(packages[name])
    call(model, 4, {slot: ([50, 60], np.arange(P, P + 2))})
    expected = call(model, 0, {slot: ([61], np.array([P + 2]))})[slot]
    call(model, 4, {slot: ([50, *TREE.tokens], TREE.positions(P))})
    stale = call(model, 0, {slot: ([61], np.array([P + 2]))})[slot]
    assert np.abs(stale - expected).max() > 0.1
    call(model, 4, {slot: ([50, *TREE.tokens], TREE.positions(P))})
    path, _ = TREE.walk_greedy(np.array([60, 0, 0, 0]))
    moves = TREE.moves(path, model.written_slots(TREE.positions(P).tolist()))
    assert moves == [(3, 1)]  # written at the slot after the chain, copied to its depth's
    model.move_kv(slot, [(P + a, P + b) for a, b in moves])
    np.testing.assert_allclose(call(model, 0, {slot: ([61], np.array([P + 2]))})[slot], expected, atol=1e-5)


@pytest.mark.usefixtures("qaic_runtime")
@pytest.mark.parametrize(("name", "backend"), [("b1", "qaic"), ("b2", "qaic"), ("cb", "qaic"), ("b1", "ort")])
def test_greedy_trees_on_the_vendor_graph_equal_none(packages, name, backend):
    """Trees around the known output (siblings accepted on odd steps, so their KV is copied by the next call): the
    output on the QAIC session equals `none`'s, token for token, on one row, two rows a call, and with continuous
    batching; and on ONNX Runtime running the same vendor graph (the copies then made on the host)."""
    package = packages[name]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in Engine(package, method="none", backend="qaic").generate(PROMPTS, params)]
    engine = Engine(package, proposer=OracleTree(plain), dispatch="cover", backend=backend)
    assert engine.model.verifies_trees
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == plain
    assert engine.dispatcher.siblings.passed > 5


@pytest.mark.usefixtures("qaic_runtime")
def test_an_eagle_head_with_tree_width_2_on_the_vendor_graph_keeps_greedy_output(tiny_model, tmp_path):
    """A random EAGLE-1 head drafting trees (its runner-up beside the first draft) on the QAIC session: `none`'s
    output."""
    from tests.test_bench_heads import save_head

    head = save_head(tiny_model("llama"), tmp_path / "head", "eagle")
    spec = make_config(num_speculative_tokens="0,1,2,4", prefill_seq_len=8, ctx_len=64)
    options = CompileOptions.create(specialization=spec, backend="qaic", draft_head=str(head), tree_inputs=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QAIC_COMPILE", str(COMPILER))
        package = compile_package(tiny_model("llama"), options, output=tmp_path / "pkg")[0]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in Engine(package, method="none", backend="qaic").generate(PROMPTS, params)]
    engine = Engine(
        package, method="eagle", tree_width=2, dispatch="cover", draft_confidence_threshold=0.0, backend="qaic"
    )
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == plain
    assert engine.model.verifies_trees and engine.dispatcher.siblings.offered > 0


@pytest.mark.usefixtures("qaic_runtime")
def test_the_tree_graph_keeps_parity_with_pytorch_on_a_sliding_window_family(tiny_model, tmp_path):
    """Gemma 2 (a window of 6 on one layer of two) on the QAIC session: an 8-token prefill chunk (wider than the
    window: the mask's window applies to the call's own tokens too), then a tree ``[last, a, b, c]``, match
    PyTorch within 1e-4: ``a``, ``b`` as the chain ``prompt + [last, a, b]``, ``c`` as ``prompt + [last, c]``."""
    from tests.test_export import TOL, reference_logits

    spec = make_config(num_speculative_tokens="0,4", ctx_len=32, prefill_seq_len=8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QAIC_COMPILE", str(COMPILER))
        model_dir = tiny_model("gemma2")
        package = compile_package(
            model_dir, CompileOptions.create(specialization=spec, backend="qaic", tree_inputs=True), output=tmp_path
        )[0]
    model = load_model(package, backend="qaic")
    prompt = np.random.default_rng(4).integers(3, 259, size=8).tolist()
    prefill = model.prefill
    prefill.reset()
    prefill.input_ids[0], prefill.position_ids[0] = prompt, np.arange(8)
    first = model.run(prefill)[0, 0].copy()
    np.testing.assert_allclose(first, reference_logits(model_dir, prompt)[7], atol=TOL)
    last, (a, b, c) = int(first.argmax()), TREE.tokens.tolist()
    tree = call(model, 4, {0: ([last, a, b, c], TREE.positions(8))})[0]
    np.testing.assert_allclose(tree[:3], reference_logits(model_dir, [*prompt, last, a, b])[8:11], atol=TOL)
    np.testing.assert_allclose(tree[3], reference_logits(model_dir, [*prompt, last, c])[9], atol=TOL)
