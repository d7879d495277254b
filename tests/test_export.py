"""Exporter: contract names and dims, logit parity with PyTorch, KV written at positions, padding, cache.

The parity and padding tests run on the vendor graph (``model.onnx``) and on the ort backend's
optimized fp32 graph (``model.ort.onnx``): both must hold the contract within the same tolerance."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from qspec import contract
from qspec.backends import ort_plan
from qspec.errors import ModelLoadError, QSpecError, UnsupportedModelError
from qspec.export import ExportOptions, export_model
from qspec.export.exporter import ONNX_FILE
from qspec.export.graph import graph_dims
from tests.conftest import FAMILIES

CTX = 16
TOL = 1e-4


GRAPHS = ["vendor", "ort"]  # model.onnx as exported; the ort backend's fused fp32 graph
# and the ort graph of a package without drafts: a one-token call's attention on its lone token (no pad)
ROW_GRAPHS = [*GRAPHS, "ort-lone"]


def row_graphs(family: str) -> list[str]:
    """The graph kinds of ``family``: ``ort-lone`` only where attention is fused (elsewhere it is the ``ort`` graph)."""
    from qspec.export.adapters import ADAPTERS

    return [g for g in ROW_GRAPHS if g != "ort-lone" or ADAPTERS[family].fused_attention]


def graph_path(folder, meta, graph: str = "vendor"):
    """The file of ``graph`` for an export: the vendor graph, or the ort backend's optimized fp32 graph."""
    return runtime_graph(folder, meta, graph)[0]


def runtime_graph(folder, meta, graph: str = "vendor"):
    """(file, RuntimeGraph or None) of ``graph`` for an export; the ort graph is copied beside the export's weights."""
    if graph == "vendor":
        return folder / ONNX_FILE, None
    from qspec.backends.ort_optimize import cached_runtime_graph

    positions = 2 * max(CTX, 48)  # ctx_len and slack of every Graph below (SmolLM2's test: ctx 48)
    graph_dir, runtime = cached_runtime_graph(
        folder,
        meta.key,
        "fp32",
        attention=meta.model.attention,
        positions=positions,
        lone_query=graph == "ort-lone",
        moe=meta.model.moe,
    )
    # it reads the export's weights (all of them when attention is not fused; none in fp32 with the MoE operator,
    # which holds its own): put it beside them
    assert ONNX_FILE + ".data" in (runtime.vendor_data_file, runtime.data_file) or runtime.fusions.get("own_weights")
    target = folder / runtime.file
    for name in {runtime.file, runtime.data_file} - {ONNX_FILE + ".data"}:
        shutil.copyfile(graph_dir / name, folder / name)
    return target, runtime


class Graph:
    """Runs an exported graph on ORT as the runtime does: each KV buffer bound as both the input and its
    ``_RetainedState`` output (updated in place), kept as numpy arrays between calls.

    A GroupQueryAttention graph gets ``ctx`` slack slots after ``ctx_len`` (``RuntimeGraph.kv_slack``).
    """

    def __init__(self, folder, meta, rows: int, graph: str = "vendor", *, ctx: int = CTX):
        path, runtime = runtime_graph(folder, meta, graph)
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        info = meta.model
        kv_len = ctx + (runtime.kv_slack(ctx) if runtime is not None else 0)
        shape = (rows, info.num_kv_heads, kv_len)
        names = info.kv_names()
        self.kv = {name: np.zeros((*shape, width), np.float32) for name, width in zip(names, info.kv_widths())}
        self._bound = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in self.kv.items()}
        self.speculative = meta.options.speculative
        self.bucketed = meta.options.comp_ctx_lengths
        self.hidden = None  # [batch, seq, hidden] of the last call, on a graph with the hidden_states output

    def run(self, ids, pos, *, keep: int = 1, batch_index=None, ccl: int = CTX):
        feeds = {contract.INPUT_IDS: np.array(ids, np.int64), contract.POSITION_IDS: np.array(pos, np.int64)}
        if batch_index is not None:
            feeds[contract.BATCH_INDEX] = np.array(batch_index, np.int64).reshape(-1, 1)
        if self.speculative:
            feeds[contract.NUM_LOGITS_TO_KEEP] = np.zeros((keep, 1), np.int64)
        if self.bucketed:
            feeds[contract.COMP_CTX_LENGTHS] = np.zeros(ccl, np.int64)
        inputs = {value.name for value in self.session.get_inputs()}
        feeds |= ort_plan.feeds(feeds[contract.POSITION_IDS], keep if self.speculative else 1, inputs)
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name, value in self._bound.items():  # wraps self.kv's arrays: the call updates them in place
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(contract.retained(name), value)
        outputs = [o.name for o in self.session.get_outputs() if not o.name.endswith(contract.RETAINED_STATE_SUFFIX)]
        for name in outputs:
            binding.bind_output(name)
        self.session.run_with_iobinding(binding)
        values = dict(zip(outputs, binding.get_outputs()[-len(outputs) :]))
        self.hidden = values[contract.HIDDEN_STATES].numpy() if contract.HIDDEN_STATES in values else None
        return values[contract.LOGITS].numpy()  # [batch, keep, vocab]


def reference_hidden(folder, tokens):
    """Final-norm hidden states of the PyTorch model over the whole sequence: [len, hidden]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0].numpy()


def reference_logits(folder, tokens):
    """Logits of the PyTorch model over the whole sequence (no cache): [len, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.fixture(scope="module")
def exported(tiny_model):
    """Factory: (model folder, export folder, meta) for a family and export options, cached per module."""
    cache = {}

    def make(family="llama", *, tie=True, **options):
        key = (family, tie, tuple(sorted(options.items())))
        if key not in cache:
            folder = tiny_model(family, tie=tie)
            cache[key] = (folder, *export_model(folder, ExportOptions(**options)))
        return cache[key]

    return make


@pytest.mark.parametrize(
    "family,tie,graph_kind",
    [(f, t, g) for f, t in [(f, True) for f in FAMILIES] + [("llama", False), ("qwen2", False)] for g in row_graphs(f)],
)
def test_parity_prefill_decode_and_rejected_draft(exported, family, tie, graph_kind):
    """Chunked prefill, 1-token decode and a K+1 decode over stale slots match PyTorch within 1e-4."""
    model_dir, folder, meta = exported(family, tie=tie)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 259, size=7).tolist()
    graph = Graph(folder, meta, rows=1, graph=graph_kind)
    # Prefill in chunks of 4: [0..3], then [4..6] + one padding token.
    first = graph.run([prompt[:4]], [[0, 1, 2, 3]], keep=4)[0]
    second = graph.run([prompt[4:] + [0]], [[4, 5, 6, -1]], keep=3)[0]
    ref = reference_logits(model_dir, prompt)
    np.testing.assert_allclose(first, ref[:4], atol=TOL)
    np.testing.assert_allclose(second, ref[4:7], atol=TOL)  # right-aligned on the 3 real tokens

    # A K=4 verify call with random drafts at positions 7..11: all five logits match.
    drafts = rng.integers(3, 259, size=4).tolist()
    last = int(np.argmax(second[-1]))
    verify = graph.run([[last] + drafts], [[7, 8, 9, 10, 11]], keep=5)[0]
    np.testing.assert_allclose(verify, reference_logits(model_dir, prompt + [last] + drafts)[7:12], atol=TOL)

    # Accept 2 drafts: slots 10, 11 now hold stale KV. The next call writes 10 and must not see 11.
    accepted = prompt + [last] + drafts[:2]
    bonus = int(np.argmax(verify[2]))
    one = graph.run([[bonus]], [[10]], keep=1)[0]
    np.testing.assert_allclose(one[0], reference_logits(model_dir, accepted + [bonus])[10], atol=TOL)


@pytest.mark.parametrize(
    "family,graph_kind",
    [(f, g) for f in ["llama", "mistral", "gemma2", "gemma3_text", "deepseek_v3"] for g in row_graphs(f)],
)
def test_decode_reaches_last_slot(exported, family, graph_kind):
    """Decoding until the token at slot ctx_len - 1 keeps parity (mistral, gemma2, gemma3_text: window 6 < ctx;
    Gemma's on one layer of two; deepseek_v3: its compressed latent cache)."""
    model_dir, folder, meta = exported(family)
    tokens = np.random.default_rng(2).integers(3, 259, size=CTX).tolist()
    graph = Graph(folder, meta, rows=1, graph=graph_kind)
    graph.run([tokens[:12]], [list(range(12))], keep=1)
    outs = [graph.run([[t]], [[p]], keep=1)[0, 0] for p, t in zip(range(12, CTX), tokens[12:])]
    ref = reference_logits(model_dir, tokens)
    np.testing.assert_allclose(np.stack(outs), ref[12:CTX], atol=TOL)  # last one is slot 15 = ctx_len - 1


@pytest.mark.parametrize("family,graph_kind", [(f, g) for f in ["llama", "deepseek_v3"] for g in row_graphs(f)])
def test_padding_rows_never_touch_live_slots(exported, family, graph_kind):
    """A fully padded row and a padded tail change no slot a live token can see, in any row (batch 2; DeepSeek-V3:
    its compressed latent cache)."""
    model_dir, folder, meta = exported(family)
    rng = np.random.default_rng(3)
    a, b = rng.integers(3, 259, size=(2, 6)).tolist()
    graph = Graph(folder, meta, rows=2, graph=graph_kind)
    graph.run([a[:4], b[:4]], [[0, 1, 2, 3], [0, 1, 2, 3]], keep=1)
    before = {k: v.copy() for k, v in graph.kv.items()}
    # Row 0 decodes two tokens; row 1 is all padding (a finished sequence), at the buffer's end too.
    out = graph.run([a[4:6], [0, 0]], [[4, 5], [-1, -1]], keep=2)
    np.testing.assert_allclose(out[0], reference_logits(model_dir, a)[4:6], atol=TOL)
    for name, value in graph.kv.items():
        np.testing.assert_array_equal(value[1], before[name][1])  # row 1: nothing changed at all
        np.testing.assert_array_equal(value[0, :, :4], before[name][0, :, :4])  # row 0: history intact
    # Row 1 resumes after the padded call: its logits are as if the padding never happened.
    out = graph.run([[0, 0], [b[4], 0]], [[-1, -1], [4, -1]], keep=1)
    np.testing.assert_allclose(out[1, 0], reference_logits(model_dir, b[:5])[4], atol=TOL)


@pytest.mark.parametrize("graph_kind", GRAPHS)
def test_deepseek_caches_the_compressed_latent_and_equals_the_expanded_cache(exported, graph_kind):
    """DeepSeek-V3's graph caches ``compressed_kv.{i}`` [batch, 1, ctx, kv_lora_rank 24] and ``k_pe.{i}``
    [batch, 1, ctx, rope 16] (QEfficient's cache_compressed), 40 floats per token and layer where the expanded
    cache (``latent_cache=False``: ``past_key.{i}`` / ``past_value.{i}`` of 4 heads, 32 + 16 wide) holds 192; a
    prefill, a K=4 verify and a decode over its stale slots give the expanded export's logits within 1e-4."""
    model_dir, folder, meta = exported("deepseek_v3")
    _, wide_folder, wide = exported("deepseek_v3", latent_cache=False)
    dims = graph_dims(graph_path(folder, meta, graph_kind))
    for i in range(meta.model.num_layers):
        assert dims[contract.latent_kv(i)] == [contract.BATCH_SIZE, 1, contract.CTX_LEN, 24]
        assert dims[contract.retained(contract.rope_key(i))] == [contract.BATCH_SIZE, 1, contract.CTX_LEN, 16]
    assert not any(name.startswith("past_") for name in dims)
    per_token = [sum(w * m.num_kv_heads for w in m.kv_widths()[:2]) for m in (meta.model, wide.model)]
    assert per_token == [40, 192]
    tokens = np.random.default_rng(12).integers(3, 259, size=12).tolist()
    graphs = [Graph(f, m, rows=1, graph=graph_kind) for f, m in ((folder, meta), (wide_folder, wide))]
    calls = [([tokens[:6]], [list(range(6))], 1), ([tokens[6:11]], [[6, 7, 8, 9, 10]], 5), ([tokens[11:]], [[8]], 1)]
    for ids, pos, keep in calls:
        compressed, expanded = (graph.run(ids, pos, keep=keep) for graph in graphs)
        np.testing.assert_allclose(compressed, expanded, atol=TOL)
    np.testing.assert_allclose(compressed[0, 0], reference_logits(model_dir, tokens[:8] + tokens[11:])[8], atol=TOL)


def test_unfused_runtime_graph_rounds_a_lone_token_as_among_several(exported):
    """DeepSeek-V3's runtime graph (attention as exported) runs a one-token call with one padding token more, so
    its logits and KV are bit-equal to the same token's in a 3-token verify call (ONNX Runtime's MatMul rounds a
    lone row otherwise, ~2e-6 apart on this model): speculative greedy output stays plain greedy output."""
    model_dir, folder, meta = exported("deepseek_v3")
    tokens = np.random.default_rng(13).integers(3, 259, size=9).tolist()
    alone, among = Graph(folder, meta, rows=1, graph="ort"), Graph(folder, meta, rows=1, graph="ort")
    for graph in (alone, among):
        graph.run([tokens[:6]], [list(range(6))], keep=1)
    one = alone.run([[tokens[6]]], [[6]], keep=1)[0, 0]
    np.testing.assert_array_equal(one, among.run([tokens[6:9]], [[6, 7, 8]], keep=3)[0, 0])
    for name in meta.model.kv_names():
        np.testing.assert_array_equal(alone.kv[name][:, :, :7], among.kv[name][:, :, :7])


@pytest.mark.parametrize("family,graph_kind", [(f, g) for f in ["llama", "deepseek_v3"] for g in row_graphs(f)])
def test_padding_at_last_slot_stays_inside_buffer(exported, family, graph_kind):
    """A live token on slot ctx_len - 1 followed by padding writes nothing out of range or over history."""
    model_dir, folder, meta = exported(family)
    tokens = np.random.default_rng(4).integers(3, 259, size=CTX).tolist()
    graph = Graph(folder, meta, rows=1, graph=graph_kind)
    graph.run([tokens[:15]], [list(range(15))], keep=1)
    before = {k: v.copy() for k, v in graph.kv.items()}
    out = graph.run([[tokens[15], 0, 0]], [[15, -1, -1]], keep=1)
    np.testing.assert_allclose(out[0, 0], reference_logits(model_dir, tokens)[15], atol=TOL)
    for name, value in graph.kv.items():
        np.testing.assert_array_equal(value[0, :, :15], before[name][0, :, :15])


@pytest.mark.parametrize("graph_kind", GRAPHS)
def test_continuous_batching_variant(exported, graph_kind):
    """batch_index routes a batch-1 prefill into its KV row and a full decode reads every row right."""
    model_dir, folder, meta = exported("qwen2", continuous_batching=True)
    dims = graph_dims(graph_path(folder, meta, graph_kind))
    assert dims[contract.BATCH_INDEX] == [contract.BATCH_SIZE, 1]
    assert dims[contract.past_key(0)][0] == contract.FULL_BATCH_SIZE
    rng = np.random.default_rng(5)
    seqs = rng.integers(3, 259, size=(3, 5)).tolist()
    graph = Graph(folder, meta, rows=3, graph=graph_kind)
    for row in (2, 0):  # rows 2 and 0 get prompts; row 1 stays empty
        graph.run([seqs[row][:4]], [[0, 1, 2, 3]], keep=1, batch_index=[row])
    out = graph.run([[seqs[0][4]], [0], [seqs[2][4]]], [[4], [-1], [4]], keep=1, batch_index=[0, 1, 2])
    np.testing.assert_allclose(out[0, 0], reference_logits(model_dir, seqs[0])[4], atol=TOL)
    np.testing.assert_allclose(out[2, 0], reference_logits(model_dir, seqs[2])[4], atol=TOL)
    assert not any(np.any(v[1]) for v in graph.kv.values())  # the empty row was never written


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("graph_kind", GRAPHS)
def test_continuous_batching_rows_of_unequal_lengths(exported, graph_kind, family):
    """One call verifying three tokens on one row, one on another and nothing on a third (the runtime
    graph runs its MatMuls on the four live tokens only) gives each row its own logits; an all-padding
    call runs and writes nothing. Every family (qwen3: q/k norm, so q, k and v scattered apart)."""
    model_dir, folder, meta = exported(family, continuous_batching=True)
    rng = np.random.default_rng(11)
    seqs = rng.integers(3, 259, size=(3, 7)).tolist()
    graph = Graph(folder, meta, rows=3, graph=graph_kind)
    for row in (0, 2):
        graph.run([seqs[row][:4]], [[0, 1, 2, 3]], keep=1, batch_index=[row])
    before = {name: value.copy() for name, value in graph.kv.items()}
    graph.run([[0, 0, 0]] * 3, [[-1, -1, -1]] * 3, keep=3, batch_index=[0, 1, 2])
    assert all(np.array_equal(graph.kv[name][:, :, :CTX], before[name][:, :, :CTX]) for name in before)
    ids = [seqs[2][4:7], [0, 0, 0], [seqs[0][4], 0, 0]]  # call rows 0, 1, 2 on KV rows 2, 1, 0
    out = graph.run(ids, [[4, 5, 6], [-1, -1, -1], [4, -1, -1]], keep=3, batch_index=[2, 1, 0])
    np.testing.assert_allclose(out[0], reference_logits(model_dir, seqs[2][:7])[4:7], atol=TOL)
    np.testing.assert_allclose(out[2, -1], reference_logits(model_dir, seqs[0][:5])[4], atol=TOL)  # right-aligned
    assert not any(np.any(v[1]) for v in graph.kv.values())
    if graph_kind != "vendor" and meta.model.attention is not None:  # attention fused (not gemma3_text)
        graph_file = graph_path(folder, meta, graph_kind)
        ops = {node.op_type for node in onnx.load(str(graph_file), load_external_data=False).graph.node}
        assert "NonZero" in ops and "Pad" not in ops  # live tokens gathered; attention's zero tokens scattered


@pytest.mark.parametrize("graph_kind", GRAPHS)
@pytest.mark.parametrize("family,batching", [("llama", False), ("qwen3", False), ("llama", True), ("qwen2", True)])
def test_hidden_states_output(exported, family, batching, graph_kind):
    """With ``hidden_states`` the graph also returns every live position's final-norm hidden state (PyTorch's
    ``hidden_states[-1]``, within 1e-4), and its logits are bit for bit those of the graph without it."""
    model_dir, plain_folder, plain_meta = exported(family, continuous_batching=batching)
    _, folder, meta = exported(family, continuous_batching=batching, hidden_states=True)
    dims = graph_dims(graph_path(folder, meta, graph_kind))
    assert dims[contract.HIDDEN_STATES][:2] == [contract.BATCH_SIZE, contract.SEQ_LEN]
    assert contract.HIDDEN_STATES not in graph_dims(graph_path(plain_folder, plain_meta, graph_kind))
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 259, size=9).tolist()
    index = {"batch_index": [0]} if batching else {}
    rows = 2 if batching else 1
    graphs = [Graph(f, m, rows=rows, graph=graph_kind) for f, m in ((plain_folder, plain_meta), (folder, meta))]
    calls = [  # a prefill chunk, a padded chunk, a K=2 verify, a one-token call
        ([prompt[:4]], [[0, 1, 2, 3]], 1),
        ([prompt[4:6] + [0]], [[4, 5, -1]], 1),
        ([prompt[6:9]], [[6, 7, 8]], 3),
        ([[prompt[8]]], [[8]], 1),
    ]
    ref = reference_hidden(model_dir, prompt)
    for ids, pos, keep in calls:
        plain, with_hidden = (g.run(ids, pos, keep=keep, **index) for g in graphs)
        assert np.array_equal(plain, with_hidden)
        live = [p for p in pos[0] if p >= 0]
        assert graphs[1].hidden.shape[:2] == (1, len(pos[0]))
        np.testing.assert_allclose(graphs[1].hidden[0, : len(live)], ref[live], atol=TOL)


def test_non_speculative_graph_keeps_one_logit(exported):
    """Without num_logits_to_keep the graph returns the last real token's logits only."""
    model_dir, folder, meta = exported("llama", speculative=False)
    assert contract.NUM_LOGITS_TO_KEEP not in graph_dims(folder / ONNX_FILE)
    tokens = np.random.default_rng(6).integers(3, 259, size=5).tolist()
    out = Graph(folder, meta, rows=1).run([tokens + [0]], [[0, 1, 2, 3, 4, -1]])
    assert out.shape == (1, 1, 320)
    np.testing.assert_allclose(out[0, 0], reference_logits(model_dir, tokens)[4], atol=TOL)


@pytest.mark.parametrize("graph_kind", GRAPHS)
def test_symbolic_dims_are_specialization_keys(exported, graph_kind):
    """Every symbolic dimension of the graph is one of the specialization keys, and vice versa."""
    from qspec.specializations import Specialization

    _, folder, meta = exported("llama", continuous_batching=True, comp_ctx_lengths=True)
    dims = graph_dims(graph_path(folder, meta, graph_kind))
    params = {d for dims in dims.values() for d in dims if isinstance(d, str)}
    assert params == set(contract.SPECIALIZATION_KEYS) == set(Specialization.model_fields)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"continuous_batching": True},
        {"comp_ctx_lengths": True},
        {"continuous_batching": True, "hidden_states": True},
    ],
)
def test_vendor_graph_writes_and_reads_kv_through_ctx_functions(exported, options):
    """Every vendor graph (batch 1, continuous batching, CCL) writes each layer's K and V with one CtxScatter
    (CtxScatterCB) call and reads them with CtxGather (CtxGatherCB), functions it defines with bodies; no plain
    scatter or gather of the KV is left in the main graph."""
    from qspec.export.graph import CTX_DOMAIN, check_ctx_functions, ctx_calls

    _, folder, meta = exported("llama", **options)
    path = folder / ONNX_FILE
    check_ctx_functions(path, meta.model.num_layers, ExportOptions(**options))
    cb = "CB" if options.get("continuous_batching") else ""
    layers = meta.model.num_layers
    # per layer and K/V: one write; one read for attention and one of the old values a padding token rewrites
    assert ctx_calls(path) == {f"CtxScatter{cb}": 2 * layers, f"CtxGather{cb}": 4 * layers}
    proto = onnx.load(str(path), load_external_data=False)
    assert {(f.domain, f.name) for f in proto.functions} == {
        (CTX_DOMAIN, f"CtxScatter{cb}"),
        (CTX_DOMAIN, f"CtxGather{cb}"),
    }
    assert not {node.op_type for node in proto.graph.node} & {"ScatterND", "ScatterElements"}
    kv = set(contract.kv_names(layers)) | {
        out for node in proto.graph.node if node.domain == CTX_DOMAIN for out in node.output
    }
    gathers = [node for node in proto.graph.node if node.op_type in ("Gather", "GatherND", "GatherElements")]
    assert not [node.name for node in gathers if node.input[0] in kv]  # the logits' pick gathers hidden states


def test_graph_loads_with_every_dimension_fixed(exported):
    """ORT loads the graph with all symbolic dims overridden (a static session) and runs it."""
    _, folder, meta = exported("llama")
    options = ort.SessionOptions()
    for name, value in {"batch_size": 1, "seq_len": 5, "ctx_len": CTX, "num_logits_to_keep": 5}.items():
        options.add_free_dimension_override_by_name(name, value)
    session = ort.InferenceSession(str(folder / ONNX_FILE), options, providers=["CPUExecutionProvider"])
    logits = [o for o in session.get_outputs() if o.name == contract.LOGITS][0]
    assert logits.shape == [1, 5, 320]


def test_export_is_cached_and_atomic(exported, tmp_path):
    """A second export returns the cached folder; no temporary folder is left behind."""
    model_dir, folder, meta = exported("llama")
    again, meta2 = export_model(model_dir, ExportOptions())
    assert again == folder and meta2 == meta
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp-")]
    assert json.loads((folder / "export.json").read_text())["model"]["num_layers"] == 2


def test_interrupted_export_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    """An export interrupted midway (the graph half written) leaves no folder a later run would take as valid."""
    import qspec.export.exporter as exporter

    def interrupted(folder, *args):
        (folder / ONNX_FILE).write_bytes(b"half a graph")
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter, "_export_in_child", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_model(tiny_model("llama"), ExportOptions(num_layers=1), cache_dir=tmp_path)
    assert list((tmp_path / "exports").iterdir()) == []


def test_export_runs_in_its_own_process(tiny_model, tmp_path, monkeypatch):
    """The export runs in a fresh process (this process's `_export_into` is never called), so the caller
    never holds the model; its progress reaches the caller's callback, phase by phase."""
    import qspec.export.exporter as exporter

    def not_here(*args):
        raise AssertionError("exported in the calling process")

    monkeypatch.setattr(exporter, "_export_into", not_here)
    said = []
    options = ExportOptions(num_layers=1)
    folder, meta = export_model(tiny_model("llama"), options, cache_dir=tmp_path, progress=said.append)
    assert (folder / ONNX_FILE).is_file() and meta.model.num_layers == 1
    assert any(line.startswith("tracing") for line in said) and "checking the ONNX graph" in said


def test_unsupported_architecture_names_supported_ones(tmp_path):
    """A GPT-2 folder is refused with the list of supported families."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.conftest import byte_tokenizer

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320)).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*supported: .*llama, mistral, .*qwen3"):
        export_model(tmp_path, cache_dir=tmp_path / "cache")


def test_missing_model_and_offline_hub_errors(tmp_path):
    """A missing file and an unknown hub id give one-line errors that say what to give instead."""
    with pytest.raises(ModelLoadError, match="does not exist"):
        export_model(tmp_path / "nope.gguf", cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="local model folder or a .gguf"):
        export_model("no-such-org-qspec/no-such-model", cache_dir=tmp_path)


def test_tied_lm_head_is_stored_once(exported):
    """A tied LM head shares the embedding's initializer; an untied one has its own, stored [hidden, vocab]."""
    import onnx

    for tie, heads in ((True, [[320, 64]]), (False, [[320, 64], [64, 320]])):
        _, folder, meta = exported("llama", tie=tie)
        proto = onnx.load(str(folder / ONNX_FILE), load_external_data=False)
        tables = sorted(list(i.dims) for i in proto.graph.initializer if sorted(i.dims) == [64, 320])
        assert tables == sorted(heads)
        assert set(meta.phase_seconds) == {"load", "trace", "optimize", "compose", "save", "check"}


def test_matmul_weights_are_stored_input_major(exported):
    """Every projection weight is a MatMul's [in, out] initializer: no weight is transposed at load time."""
    import onnx

    _, folder, _ = exported("llama", tie=False)
    graph = onnx.load(str(folder / ONNX_FILE), load_external_data=False).graph
    weights = {tensor.name for tensor in graph.initializer}
    matmul_weights = [node.input[1] for node in graph.node if node.op_type == "MatMul" and node.input[1] in weights]
    assert len(matmul_weights) == 2 * 7 + 1  # two layers of 7 projections, and the LM head
    transposed = [node.input[0] for node in graph.node if node.op_type == "Transpose" and node.input[0] in weights]
    assert transposed == []


def test_layers_of_different_signatures_keep_parity(tmp_path):
    """Qwen2 with sliding and full attention layers: one traced function per kind, each layer its weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import byte_tokenizer, tiny_config

    config = tiny_config("qwen2", layers=3)
    config.use_sliding_window, config.sliding_window = True, 4
    config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    folder, meta = export_model(tmp_path / "model", ExportOptions(), cache_dir=tmp_path / "cache")
    tokens = np.random.default_rng(8).integers(3, 259, size=9).tolist()
    graph = Graph(folder, meta, rows=1)
    out = graph.run([tokens], [list(range(9))], keep=9)[0]
    np.testing.assert_allclose(out, reference_logits(tmp_path / "model", tokens), atol=TOL)  # window 4 < 9


def test_missing_export_extra_says_what_to_install(tiny_model, monkeypatch):
    """Without onnxscript the exporter says to install qspec[export], before any work."""
    import sys

    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(QSpecError, match=r"needs onnxscript.*pip install 'qspec\[export\]'"):
        export_model(tiny_model("llama"), ExportOptions(num_layers=1))


@pytest.mark.parametrize("family,tie", [("qwen2", False), ("llama", True)])
def test_packed_qkv_attention_equals_separate_projections(exported, tmp_path, family, tie):
    """One packed q/k/v MatMul (+ packed bias, qwen2) fed to GroupQueryAttention gives the logits of three."""
    import onnx_ir as ir

    from qspec.backends.ort_attention import fuse_attention
    from qspec.onnx_files import load_model

    model_dir, folder, meta = exported(family, tie=tie)
    outputs = {}
    for pack in (False, True):
        model = load_model(folder / ONNX_FILE)  # the export's weights may be linked into packages
        ir.external_data.load_to_model(model)
        assert fuse_attention(model, meta.model.attention, 64, pack_qkv=pack) == meta.model.num_layers
        ops = [node.op_type for node in model.graph]
        assert ops.count("MatMul") == meta.model.num_layers * (5 if pack else 7) + 1
        path = tmp_path / f"{family}-{pack}.onnx"
        ir.save(model, str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        kv = {
            name: np.zeros((1, meta.model.num_kv_heads, 32, meta.model.head_dim), np.float32)
            for name in contract.kv_names(meta.model.num_layers)
        }
        feeds = {
            contract.INPUT_IDS: np.array([[5, 9, 17, 33, 0]], np.int64),
            contract.POSITION_IDS: np.array([[0, 1, 2, 3, -1]], np.int64),
            contract.NUM_LOGITS_TO_KEEP: np.zeros((4, 1), np.int64),
        }
        outputs[pack] = session.run([contract.LOGITS], feeds | kv)[0]
    np.testing.assert_allclose(outputs[True], outputs[False], atol=1e-5)
    np.testing.assert_allclose(outputs[True][0], reference_logits(model_dir, [5, 9, 17, 33]), atol=TOL)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_comp_ctx_lengths_bounds_the_slots_read(exported, family):
    """A comp_ctx_lengths input of length 8 makes attention read slots 0..7 only: NaNs beyond are never seen
    (gemma2: a sliding window of 6 on layer 0 within the bucket, and K + 1 tokens verified in it)."""
    model_dir, folder, meta = exported(family, comp_ctx_lengths=True)
    tokens = np.random.default_rng(9).integers(3, 259, size=10).tolist()
    ref = reference_logits(model_dir, tokens)
    graph = Graph(folder, meta, rows=1)
    for value in graph.kv.values():
        value[:, :, 8:] = np.nan  # stale garbage in the slots past the bucket
    out = graph.run([tokens[:6]], [list(range(6))], keep=6, ccl=8)[0]
    np.testing.assert_allclose(out, ref[:6], atol=TOL)
    out = graph.run([tokens[6:8]], [[6, 7]], keep=2, ccl=8)[0]  # positions up to 7: the bucket's last slot
    np.testing.assert_allclose(out, ref[6:8], atol=TOL)
    # With the whole buffer, the slots past the last position are read at slot 0 (QEfficient's CtxGather index):
    # the NaNs stay unread there too.
    out = graph.run([tokens[8:9]], [[8]], ccl=CTX)[0]
    np.testing.assert_allclose(out, ref[8:9], atol=TOL)
