"""The EAGLE head's fused runtime graph (GroupQueryAttention) gives its vendor graph's and PyTorch's drafts."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qspec import contract  # noqa: E402
from qspec.head_manifest import HEAD_ONNX, HEAD_ORT_ONNX  # noqa: E402
from qspec.heads import export, modules, ort_graph  # noqa: E402
from qspec.runtime.head_graph import HeadGraph  # noqa: E402
from tests.test_heads_export import CTX, as_stored, compile_into  # noqa: E402
from tests.test_heads_modules import randomize, tiny_target  # noqa: E402

WIDTHS = (1, 2, 5, 8)  # the test packages' head shapes: chain, catch-ups (K = 0, 1, 4), prefill
TOL = 1e-4


def compiled(tmp_path, **overrides):
    """A tiny random EAGLE head (reduced vocabulary) compiled into a package; (package, manifest, torch head)."""
    target = tiny_target()
    head = randomize(modules.eagle_from_target(target, draft_ids=torch.tensor([4, 9, 2, 130, 77, 300, 31, 8])))
    modules.save_eagle(head, tmp_path / "head")
    package, manifest = compile_into(tmp_path, tmp_path / "head", target, **overrides)
    return package, manifest, as_stored(modules.load_eagle(tmp_path / "head", target))


def streams(count: int, seed: int = 3):
    """``count`` sequences of CTX (token, feature) pairs: ids [CTX], features [CTX, 64]."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 320, (CTX,), generator=generator), torch.randn(CTX, 64, generator=generator))
        for _ in range(count)
    ]


def drive(path, pairs, kv_shape, *, rows: int, batch_index: bool, seed: int):
    """Write every stream's pairs through the graph at ``path``, run as the runtime runs it, in calls of random
    widths and chunk lengths (positions 0 .. CTX - 1, one-token calls at the last two); returns ``{(stream, last
    position): (logits, feature)}`` of every call's rows. Stream s lives in KV row s (``batch_index``: calls
    over random subsets in random orders; else every row in every call, finished rows idle)."""
    graph = HeadGraph(path, rows=rows, kv=kv_shape)  # the runtime's: KV bound in place
    rng = np.random.default_rng(seed)
    done = [0] * len(pairs)
    out = {}
    while min(done) < CTX:
        live = [s for s in range(len(pairs)) if done[s] < CTX]
        if batch_index:
            called = [s for s in live if rng.random() < 0.7] or live[:1]
            rng.shuffle(called)
        else:
            called = list(range(len(pairs)))
        width = int(rng.choice(WIDTHS))
        ids = np.zeros((len(called), width), np.int64)
        positions = np.full((len(called), width), contract.PAD_POSITION, np.int64)
        hidden = np.zeros((len(called), width, 64), np.float32)
        spans = []
        for i, s in enumerate(called):
            n = 0 if done[s] == CTX else min(int(rng.integers(1, width + 1)), CTX - done[s])
            if CTX - done[s] <= 2:
                n = min(n, 1)  # one-token calls at CTX - 2 and CTX - 1 (the op's padding token past the end)
            ids[i, :n] = pairs[s][0][done[s] : done[s] + n].numpy()
            hidden[i, :n] = pairs[s][1][done[s] : done[s] + n].numpy()
            positions[i, :n] = np.arange(done[s], done[s] + n)
            spans.append((i, s, n))
            done[s] += n
        feeds = {contract.INPUT_IDS: ids, contract.POSITION_IDS: positions, contract.HIDDEN_STATES: hidden}
        if batch_index:
            feeds[contract.BATCH_INDEX] = np.asarray(called, np.int64)[:, None]
        result = graph.run(feeds)
        logits, feature = result[contract.LOGITS], result[contract.HIDDEN_STATES_OUT]
        for i, s, n in spans:
            if n:
                out[(s, done[s] - 1)] = (logits[i, 0].copy(), feature[i, 0].copy())  # the graph reuses its outputs
    return out


def check_equal(package, manifest, head, *, rows: int, batch_index: bool, seed: int = 0) -> None:
    pairs = streams(rows)
    vendor_kv = (manifest.num_kv_heads, CTX, manifest.head_dim)
    common = dict(rows=rows, batch_index=batch_index, seed=seed)
    vendor = drive(manifest.path(package, HEAD_ONNX), pairs, vendor_kv, **common)
    fused = drive(manifest.path(package, manifest.runtime_graph), pairs, manifest.kv_shape, **common)
    assert vendor.keys() == fused.keys() and len(fused) > 2 * rows  # the same calls, several per stream
    with torch.no_grad():
        want = [head(ids[None], hidden[None], torch.arange(CTX)[None])[0] for ids, hidden in pairs]  # [CTX, 64]
        want_logits = [head.logits(w) for w in want]
    for (s, position), (logits, feature) in fused.items():
        np.testing.assert_allclose(feature, vendor[(s, position)][1], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(logits, vendor[(s, position)][0], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(feature, want[s][position].numpy(), rtol=TOL, atol=TOL)
        np.testing.assert_allclose(logits, want_logits[s][position].numpy(), rtol=TOL, atol=TOL)


def test_fused_graph_records_its_fusions(tmp_path):
    """fp32 gets head.ort.onnx: one GroupQueryAttention, no CtxGather; the manifest says what was fused."""
    import onnx

    package, manifest, _ = compiled(tmp_path)
    assert manifest.runtime_graph == HEAD_ORT_ONNX and manifest.quantized_matmuls == 0
    assert manifest.fusions["group_query_attention"] == 1 and manifest.fusions["skip_rms_normalization"] == 1
    assert manifest.kv_slack == 8 and manifest.rope_positions == CTX + 8  # the prefill's 8 tokens past a position
    assert manifest.kv_shape == (2, CTX + 8, 16)
    proto = onnx.load(str(manifest.path(package, HEAD_ORT_ONNX)), load_external_data=False)
    ops = Counter(node.op_type for node in proto.graph.node)
    assert ops["GroupQueryAttention"] == 1 and ops["SkipSimplifiedLayerNormalization"] == 1
    assert not [op for op in ops if op.startswith("Ctx")] and not proto.functions
    vendor = onnx.load(str(manifest.path(package, HEAD_ONNX)), load_external_data=False)
    assert len(proto.graph.node) < len(vendor.graph.node) / 2


def test_fused_graph_equals_vendor_graph_and_torch(tmp_path):
    """Batch 2, every width, padded and idle rows, positions up to ctx_len - 1: the fused graph's logits and
    features are the vendor graph's and the torch head's."""
    package, manifest, head = compiled(tmp_path)
    check_equal(package, manifest, head, rows=2, batch_index=False)


def test_fused_graph_continuous_batching(tmp_path):
    """With batch_index (3 KV rows, calls over random subsets in random order) the fused graph equals both."""
    package, manifest, head = compiled(tmp_path, spec={"full_batch_size": 3})
    assert contract.BATCH_INDEX in manifest.input_names
    check_equal(package, manifest, head, rows=3, batch_index=True, seed=1)


def test_fused_int4_graph_equals_the_unfused_int4_graph(tmp_path):
    """int4: the fused graph's logits are those of the vendor graph quantized alike (packed q/k/v quantizes
    column by column, as q, k and v alone)."""
    package, manifest, head = compiled(tmp_path, weight_format="int4")
    unfused = ort_graph.copy_model(
        export.trace_eagle(modules.load_eagle(tmp_path / "head", tiny_target()), continuous_batching=False)
    )
    path = tmp_path / "unfused.onnx"
    ort_graph.write_runtime_graph(unfused, path, weight_format="int4")
    pairs = streams(2, seed=4)
    common = dict(rows=2, batch_index=False, seed=2)
    fused = drive(manifest.path(package, manifest.runtime_graph), pairs, manifest.kv_shape, **common)
    plain = drive(path, pairs, (manifest.num_kv_heads, CTX, manifest.head_dim), **common)
    assert fused.keys() == plain.keys()
    for key, (logits, feature) in fused.items():
        np.testing.assert_allclose(feature, plain[key][1], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(logits, plain[key][0], rtol=1e-3, atol=1e-3)
