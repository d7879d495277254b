"""Single-call (parallel) drafting with an EAGLE-1 head (qspec.heads.parallel): the mask slots' arithmetic against
the head's own forward, the checkpoint, ``train-head --parallel`` on a tiny model whose next token is a function of
the current one (tests/test_heads_e2e.py), and greedy output equal to ``none`` with every draft of a step from one
head call, fp32 and int4, one row and two rows a call."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qspec.heads.eagle import EagleHead, eagle_config, load_eagle, save_eagle
from qspec.heads.parallel import ParallelDrafting, enable_parallel, group_forward, slot_labels
from qspec.runtime import Engine, SamplingParams
from tests.test_heads_e2e import PROMPTS, compile_tiny, markov_model
from tests.test_heads_export import fake_compiler  # noqa: F401 (a fixture)


def random_head(depth: int = 3) -> EagleHead:
    from tests.conftest import tiny_config

    torch.manual_seed(1)
    config = eagle_config(tiny_config("llama"))
    vocab, hidden = config.vocab_size, config.hidden_size
    head = EagleHead(config, torch.randn(vocab, hidden), torch.randn(vocab, hidden))
    with torch.no_grad():
        for param in head.parameters():
            if param.requires_grad:
                param.normal_(0, 0.2)
    return enable_parallel(head, ParallelDrafting(depth=depth, mask_token_id=3), torch.randn(hidden)).eval()


def test_mask_slots_are_the_heads_forward_over_mask_pairs():
    """Slot s of anchor t is the head's own causal forward over pairs 0..t and s + 1 mask pairs (the mask token's
    embedding, the mask feature) at positions t + 1 .. t + 1 + s; the verified pairs' rows are its forward over
    them alone. Two anchors of one sequence and an empty anchor in a batch of two."""
    head = random_head(depth=4)
    n, hidden = 9, head.fc.weight.shape[0]
    ids = torch.randint(0, head.embed_tokens.weight.shape[0], (2, n))
    feats = torch.randn(2, n, hidden)
    anchors = torch.tensor([[2, 6], [5, -1]])
    with torch.no_grad():
        real, slots = group_forward(head, ids, feats, anchors)
        np.testing.assert_allclose(
            real.numpy(), head(ids, feats, torch.arange(n).expand(2, n)).numpy(), atol=1e-4, rtol=1e-5
        )
        for row, t in ((0, 2), (0, 6), (1, 5)):
            a = anchors[row].tolist().index(t)
            masks = 3
            seq_ids = torch.cat((ids[row, : t + 1], torch.full((masks,), 3)))[None]
            seq_feats = torch.cat((feats[row, : t + 1], head.mask_hidden.expand(masks, hidden)))[None]
            expected = head(seq_ids, seq_feats, torch.arange(t + 1 + masks)[None])[0, t + 1 :]
            np.testing.assert_allclose(slots[row, a].numpy(), expected.numpy(), atol=1e-4, rtol=1e-5)


def test_slot_labels_are_the_pairs_after_the_anchor():
    """Slot s of anchor t learns pair t + 1 + s's label (the greedy token after x_{t + s + 2}); none past the end."""
    labels = torch.arange(10, 16)[None]  # pairs 0..5
    assert slot_labels(labels, torch.tensor([[1, 4, -1]]), 3, -100).tolist() == [
        [[12, 13, 14], [15, -100, -100], [-100, -100, -100]]
    ]


def test_a_parallel_head_keeps_its_mask_and_settings_in_its_checkpoint(tmp_path):
    """EAGLE-1's files plus ``mask_hidden`` and ``parallel_drafting`` in config.json; loaded back alike."""
    head = random_head()
    folder = save_eagle(head, tmp_path / "head", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["parallel_drafting"] == {"depth": 3, "mask_token_id": 3}

    class Target:
        def get_input_embeddings(self):
            return head.embed_tokens

        def get_output_embeddings(self):
            return head.lm_head

    loaded = load_eagle(folder, Target())
    assert loaded.parallel == head.parallel
    torch.testing.assert_close(loaded.mask_hidden, head.mask_hidden)


@pytest.fixture(scope="module")
def parallel_head(tmp_path_factory):
    """A head trained by ``qspec train-head --parallel 3`` on the tiny next-token-of-the-current-token model."""
    from qspec_cli.main import app
    from typer.testing import CliRunner

    root = tmp_path_factory.mktemp("parallel")
    target = markov_model(root / "markov")
    package = compile_tiny(target, root / "hs", hidden_states=True)
    args = ["train-head", str(package), "--output", str(root / "head"), "--method", "eagle", "--parallel", "3"]
    args += ["--prompts", "40", "--dialogues", "40", "--max-new-tokens", "40", "--epochs", "8", "--magpie", "0"]
    args += ["--draft-vocab", "320", "--lr", "3e-3", "--work-dir", str(root / "work"), "--eval-mt-bench", "0"]
    args += ["--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return target, root / "head", json.loads(result.output[result.output.index("{") :])


def test_parallel_training_learns_every_depth(parallel_head):
    """The log has one call's accuracy at depths 1..3 beside the chained one; depth 1 learns, deeper is a
    subset of it."""
    _, folder, log = parallel_head
    last = log["epochs"][-1]
    one_call = last["held_out_one_call_accuracy"]
    assert len(one_call) == 3 and one_call[0] > 0.2 and one_call[0] >= one_call[1] >= one_call[2] >= 0
    assert "ce_slot2" in last["train"]
    assert json.loads((folder / "config.json").read_text())["parallel_drafting"]["depth"] == 3


class CallCounter:
    """Counts a head graph's calls by how many rows each keeps."""

    def __init__(self, graph):
        self.graph, self.calls, self.run = graph, [], graph.run

        def run(feeds, *, keep: int = 1):
            self.calls.append(keep)
            return self.run(feeds, keep=keep)

        graph.run = run


@pytest.mark.parametrize("weight_format", ["fp32", "int4"])
def test_one_call_drafting_is_greedy(parallel_head, tmp_path, weight_format):
    """Greedy output with the parallel head equals `none` of the same package (cover and auto dispatch), every
    head call keeping three rows (no chained call), calls verifying three drafts; with ``parallel_drafting=False``
    the same head drafts chained (one-row calls), output again `none`'s."""
    target, folder, _ = parallel_head
    package = compile_tiny(target, tmp_path / "p", weight_format=weight_format, draft_head=str(folder))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in Engine(package, method="none").generate(PROMPTS, params)]
    reached = {}
    for dispatch in ("cover", "auto"):  # cover: every draft the head has, whatever its probability
        threshold = 0.0 if dispatch == "cover" else None
        engine = Engine(package, method="eagle", dispatch=dispatch, draft_confidence_threshold=threshold)
        counter = CallCounter(engine.proposer.head)
        assert [o.token_ids for o in engine.generate(PROMPTS, params)] == plain, dispatch
        assert 3 in counter.calls, dispatch
        reached[dispatch] = engine.last_metrics.reached_per_position
        if dispatch == "cover":  # every step's drafts pay: one call a step drafts every token
            assert set(counter.calls) == {3}
    assert len(reached["cover"]) == 3 and reached["cover"][1] > 0, reached  # three drafts a call verified
    chained = Engine(package, method="eagle", dispatch="cover", parallel_drafting=False)
    counter = CallCounter(chained.proposer.head)
    assert [o.token_ids for o in chained.generate(PROMPTS, params)] == plain
    assert set(counter.calls) == {1}


def test_continuous_batching_drafts_in_one_call_and_greedy(parallel_head, tmp_path):
    """Four KV slots (the head graph takes batch_index and hands out each row's last three rows): every step's drafts
    come from one head call, six requests' outputs equal `none` at batch 1; chained again with
    ``parallel_drafting=False``."""
    target, folder, _ = parallel_head
    package = compile_tiny(target, tmp_path / "p", fbs=4, draft_head=str(folder))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = PROMPTS + [[7, 7, 8, 9, 10], list(range(60, 75))]
    plain = [o.token_ids for o in Engine(package, method="none", max_batch_size=1).generate(prompts, params)]
    engine = Engine(package, method="eagle", dispatch="cover", draft_confidence_threshold=0.0)
    counter = CallCounter(engine.proposer.head)
    assert [o.token_ids for o in engine.generate(prompts, params)] == plain
    assert set(counter.calls) == {3}
    assert engine.last_metrics.reached_per_position[1] > 0  # second drafts, from the same call, were verified
    chained = Engine(package, method="eagle", dispatch="cover", parallel_drafting=False)
    counter = CallCounter(chained.proposer.head)
    assert [o.token_ids for o in chained.generate(prompts, params)] == plain
    assert set(counter.calls) == {1}


def test_the_vendor_head_graph_hands_out_a_parallel_heads_drafts(parallel_head, tmp_path, fake_compiler):  # noqa: F811
    """backend qaic: the vendor graph ``head.onnx`` returns each row's last three rows (logits and features),
    equal to the trained head's forward over its pairs and mask pairs, rows of two lengths in one call; the
    specializations add ``K + min(3, K)`` per compiled K (a step's pairs and its mask pairs) and the stand-in
    compiler takes them."""
    import onnxruntime as ort

    from qspec.head_manifest import read_head_manifest

    target, folder, _ = parallel_head
    package = compile_tiny(target, tmp_path / "p", draft_head=str(folder), backend="qaic")
    head_dir = package / "head"
    wire = json.loads((head_dir / "specializations.json").read_text())["specializations"]
    assert [int(entry["seq_len"]) for entry in wire] == [8, 1, 2, 3, 4, 5, 7]  # K = 0, 1, 2, 4: K + 1, K + min(3, K)
    assert (head_dir / "qpc" / "programqpc.bin").is_file()
    manifest = read_head_manifest(package)
    session = ort.InferenceSession(str(head_dir / "head.onnx"), providers=["CPUExecutionProvider"])
    head = load_eagle(folder, _tables(target))
    hidden, mask = head.fc.weight.shape[0], manifest.mask_token_id
    mask_feature = np.load(head_dir / "mask_hidden.npy")
    rng = np.random.default_rng(0)
    width, lengths = 9, (7, 3)
    ids = np.zeros((2, width), np.int64)
    positions = np.full((2, width), -1, np.int64)
    feats = np.zeros((2, width, hidden), np.float32)
    expected_logits, expected_features = [], []
    for row, n in enumerate(lengths):
        row_ids = np.concatenate((rng.integers(0, 300, n), [mask, mask]))
        row_feats = np.concatenate((rng.standard_normal((n, hidden)), mask_feature[None].repeat(2, 0)))
        ids[row, : n + 2], positions[row, : n + 2], feats[row, : n + 2] = row_ids, np.arange(n + 2), row_feats
        with torch.no_grad():
            features = head(
                torch.from_numpy(row_ids[None]),
                torch.from_numpy(feats[row : row + 1, : n + 2]),
                torch.arange(n + 2)[None],
            )
        expected_features.append(features[0, -3:].numpy())
        expected_logits.append(head.logits(features)[0, -3:].numpy())
    kv = np.zeros((2, manifest.num_kv_heads, manifest.ctx_len, manifest.head_dim), np.float32)
    feeds = {"input_ids": ids, "position_ids": positions, "hidden_states": feats, "past_key.0": kv, "past_value.0": kv}
    logits, features = session.run(["logits", "hidden_states_out"], feeds)
    assert logits.shape[:2] == features.shape[:2] == (2, 3)
    np.testing.assert_allclose(logits, np.stack(expected_logits), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(features, np.stack(expected_features), atol=2e-2, rtol=2e-2)
    assert (logits.argmax(-1) == np.stack(expected_logits).argmax(-1)).all()


def test_the_packages_head_graph_drafts_as_the_trained_head(parallel_head, tmp_path):
    """One call of the package's head graph keeping three rows (the last pair's and two mask pairs') gives the
    trained head's logits over the same pairs and mask pairs (fp32 MatMuls; its weights stored in float16)."""
    from qspec.head_manifest import read_head_manifest
    from qspec.runtime.heads import load_head_proposer

    target, folder, _ = parallel_head
    package = compile_tiny(target, tmp_path / "p", draft_head=str(folder), draft_head_weight_format="fp32")
    manifest = read_head_manifest(package)
    settings = json.loads((folder / "config.json").read_text())["parallel_drafting"]
    assert (manifest.parallel_depth, manifest.mask_token_id) == (3, settings["mask_token_id"])
    graph = load_head_proposer("eagle", package).head
    head = load_eagle(folder, _tables(target))
    hidden = head.fc.weight.shape[0]
    rng = np.random.default_rng(0)
    n = 7
    mask = manifest.mask_token_id
    ids = np.concatenate((rng.integers(0, 300, n), [mask, mask]))[None].astype(np.int64)
    feats = np.concatenate(
        (rng.standard_normal((n, hidden)), np.load(package / "head" / "mask_hidden.npy")[None].repeat(2, 0))
    )
    feats = feats[None].astype(np.float32)
    out = graph.run({"input_ids": ids, "position_ids": np.arange(n + 2)[None], "hidden_states": feats}, keep=3)
    with torch.no_grad():
        expected = head.logits(head(torch.from_numpy(ids), torch.from_numpy(feats), torch.arange(n + 2)[None]))[0, -3:]
    np.testing.assert_allclose(out["logits"][0], expected.numpy(), atol=2e-2, rtol=2e-2)
    assert (out["logits"][0].argmax(-1) == expected.numpy().argmax(-1)).all()


def _tables(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def test_mask_pairs_that_do_not_pay_give_way_to_the_chain(parallel_head, tmp_path):
    """When dispatch would verify none of a step's mask drafts, the next steps draft chained (one-row calls, as
    EAGLE-1) and mask pairs are tried again every MASK_RETRY_STEPS steps; greedy output stays `none`'s."""
    from qspec.runtime.heads import MASK_RETRY_STEPS

    target, folder, _ = parallel_head
    package = compile_tiny(target, tmp_path / "p", draft_head=str(folder))
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = Engine(package, method="none").generate(PROMPTS[:1], params)[0].token_ids
    engine = Engine(package, method="eagle", dispatch="cover", draft_confidence_threshold=0.0)
    engine.proposer.depth_limit = lambda *args: 1  # whatever the dispatch says, one draft is all that would pay
    widths = []
    run = engine.proposer.head.run

    def counted(feeds, *, keep: int = 1):
        widths.append(keep)
        return run(feeds, keep=keep)

    engine.proposer.head.run = counted
    assert engine.generate(PROMPTS[:1], params)[0].token_ids == plain
    # mask pairs first, then MASK_RETRY_STEPS steps of one chained call each (the chain stops at one draft), again
    text = "".join("m" if keep == 3 else "c" for keep in widths)
    assert text.startswith("m") and "m" + "c" * MASK_RETRY_STEPS + "m" in text, text
    assert "c" * (MASK_RETRY_STEPS + 1) not in text, text


def test_init_head_starts_from_a_trained_head(parallel_head, tmp_path):
    """``--init-head``: training starts from the given head (its draft vocabulary kept) and logs the option."""
    from transformers import AutoModelForCausalLM

    from qspec.heads.train import TrainOptions, train_head

    target, folder, _ = parallel_head
    features = sorted((folder.parent / "work").glob("features-*.npz"))
    options = TrainOptions(method="eagle", epochs=1, batch_sequences=4, threads=1, parallel=3, init_head=folder)
    log = train_head(features, AutoModelForCausalLM.from_pretrained(target), tmp_path / "again", options)
    assert json.loads((tmp_path / "again" / "train_log.json").read_text())["options"]["init_head"] == str(folder)
    first, again = load_eagle(folder, _tables(target)), load_eagle(tmp_path / "again", _tables(target))
    assert torch.equal(first.draft_ids, again.draft_ids) and again.parallel == first.parallel
    assert log["epochs"][0]["held_out_one_call_accuracy"][0] > 0.2  # it starts trained
