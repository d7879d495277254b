"""Quantized weights (int8/int4, MatMulNBits) and the ort backend's optimized graph, on tiny random models."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from qspec.backends import ort_plan
from qspec.compile import CompileOptions, compile_package
from qspec.errors import ConfigError
from qspec.package import ONNX_FILE, ORT_ONNX_FILE, read_manifest
from qspec.quality import compare_packages, teacher_forced_argmax
from qspec.runtime import Engine, SamplingParams
from qspec.specializations import make_config
from tests.test_runtime import PROMPTS, run

CTX = 64
FORMATS = ("int8", "int4")


def compile_format(model, folder, ks, weight_format, *, fbs=None):
    config = make_config(num_speculative_tokens=ks, prefill_seq_len=8, ctx_len=CTX, full_batch_size=fbs)
    options = CompileOptions(specialization=config, weight_format=weight_format)
    return compile_package(model, options, output=folder)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def packages(model, tmp_path_factory):
    """``packages[fmt][name]``: K lists [0,4], [4], [0,1,2,4,8] at batch 1 and [0,4] with 4 KV slots."""
    root = tmp_path_factory.mktemp("formats")
    made = {}
    for fmt in ("fp32", *FORMATS):
        made[fmt] = {
            "0,4": compile_format(model, root / f"{fmt}-k04", "0,4", fmt)[0],
            "4": compile_format(model, root / f"{fmt}-k4", "4", fmt)[0],
            "0,1,2,4,8": compile_format(model, root / f"{fmt}-kdense", "0,1,2,4,8", fmt)[0],
            "cb": compile_format(model, root / f"{fmt}-cb", "0,4", fmt, fbs=4)[0],
        }
    return made


def matmul_ops(package) -> dict[str, int]:
    graph = onnx.load(str(package / ORT_ONNX_FILE), load_external_data=False).graph
    ops = [node.op_type for node in graph.node]
    return {op: ops.count(op) for op in ("MatMul", "MatMulNBits", "Gather", "GatherBlockQuantized")}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ks", ["0,4", "4", "0,1,2,4,8"])
def test_speculative_greedy_equals_plain_greedy_of_the_same_package(packages, fmt, ks):
    """pld and suffix outputs equal `none` of the same quantized package, for every K list."""
    plain, _ = run(packages[fmt][ks], PROMPTS, method="none")
    auto, auto_engine = run(packages[fmt][ks], PROMPTS, method="pld")
    assert auto == plain and auto_engine.dispatcher.mode == "auto"  # cost for greedy steps here (fp32 one slot: cover)
    spec, engine = run(packages[fmt][ks], PROMPTS, method="pld", dispatch="cover")  # every draft verified
    assert spec == plain
    assert run(packages[fmt][ks], PROMPTS, method="suffix")[0] == plain
    assert engine.last_metrics.accepted > 0, "the repeating prompts must have produced accepted drafts"


@pytest.mark.parametrize("fmt", FORMATS)
def test_continuous_batching_equals_batch_one(packages, fmt):
    """4 KV slots, 5 requests of different budgets: each equals the batch-1 `none` run of its format."""
    budgets = [20, 7, 13, 3, 16]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets]
    outputs = Engine(packages[fmt]["cb"], method="pld").generate(PROMPTS, params)
    alone = Engine(packages[fmt]["0,4"], method="none")
    for prompt, n, out in zip(PROMPTS, budgets, outputs):
        [ref] = alone.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))
        assert out.token_ids == ref.token_ids


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_matmul_weight_is_quantized_lm_head_included(packages, fmt):
    """2 layers x 5 projections (q, k, v packed into one) + the tied LM head are MatMulNBits; the embedding
    reads the head's blocks (GatherBlockQuantized)."""
    package = packages[fmt]["0,4"]
    ops = matmul_ops(package)
    assert ops["MatMulNBits"] == 2 * 5 + 1 and ops["MatMul"] == 0
    manifest = read_manifest(package)
    assert manifest.weight_format == fmt
    graph = manifest.runtime_graph
    assert graph.file == ORT_ONNX_FILE and graph.quantized_matmuls == 11
    assert graph.fusions["materialized_weights"] == 1  # the tied head got its own [hidden, vocab] weight
    # Symmetric blocks: a scale per block and no zero point (the faster int8-activation kernels).
    assert graph.symmetric is True and graph.block_size == 32
    nodes = onnx.load(str(package / ORT_ONNX_FILE), load_external_data=False).graph.node
    assert all(len([name for name in node.input if name]) == 3 for node in nodes if node.op_type == "MatMulNBits")
    fp32 = read_manifest(packages["fp32"]["0,4"]).runtime_graph
    # The LM head alone is 64 x 320 fp32 = 80 KiB; int4 streams about 1/6 of fp32's bytes (the scales).
    assert graph.weight_bytes < fp32.weight_bytes / (2.5 if fmt == "int8" else 4.5)
    assert not (package / ONNX_FILE).exists()  # the vendor graph only with --backend qaic or --vendor-graph


def test_fp32_runtime_graph_is_fused_and_keeps_the_contract(model, tmp_path):
    """fp32: RMSNorm and skip-RMSNorm fused, no MatMulNBits, same inputs and outputs as model.onnx (shipped when
    asked: an ort package holds no vendor graph by default)."""
    config = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=CTX)
    options = CompileOptions(specialization=config, weight_format="fp32", vendor_graph=True)
    package = compile_package(model, options, output=tmp_path / "fp32-vendor")[0]
    graph = read_manifest(package).runtime_graph
    assert graph.weight_format == "fp32" and graph.quantized_matmuls == 0
    assert graph.fusions["rms_normalization"] >= 1 and graph.fusions["skip_rms_normalization"] >= 1
    assert matmul_ops(package)["MatMulNBits"] == 0

    def io(path):
        proto = onnx.load(str(path), load_external_data=False).graph
        return [
            (v.name, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in list(proto.input) + list(proto.output)
        ]

    # the contract's inputs and outputs, and the call plan the host computes (qspec.backends.ort_plan)
    runtime, vendor = io(package / ORT_ONNX_FILE), io(package / ONNX_FILE)
    plan = [(name, dims) for name, dims in runtime if name.startswith("plan_")]
    assert [entry for entry in runtime if entry not in plan] == vendor
    assert [name for name, _ in plan] == ort_plan.plan_names({name for name, _ in plan}) and plan
    # a package with drafts pads a one-token call's attention: a tree graph places each token at its op slot
    assert ort_plan.QUERY in dict(plan) and ort_plan.OP_INDEX in dict(plan) and ort_plan.QUERY_PADS not in dict(plan)


@pytest.mark.parametrize("fmt", ("fp32", *FORMATS))
def test_runtime_graph_attends_with_one_group_query_attention_per_layer(packages, fmt):
    """Every layer's attention (RoPE, KV write at positions, mask, softmax) is one GroupQueryAttention node,
    also with continuous batching (the call's rows scattered to their KV rows); the KV buffers get slack slots."""

    def ops(package) -> list[str]:
        return [node.op_type for node in onnx.load(str(package / ORT_ONNX_FILE), load_external_data=False).graph.node]

    plain = ops(packages[fmt]["0,4"])
    assert plain.count("GroupQueryAttention") == 2
    assert "ScatterElements" not in plain and "Softmax" not in plain
    graph = read_manifest(packages[fmt]["0,4"]).runtime_graph
    assert graph.kv_slack and graph.fusions["group_query_attention"] == 2
    cb = ops(packages[fmt]["cb"])
    assert cb.count("GroupQueryAttention") == 2 and "ScatterElements" not in cb
    assert read_manifest(packages[fmt]["cb"]).runtime_graph.kv_slack
    # MatMuls over live tokens only: packed with several KV rows, rows trimmed without (no node per layer moves them)
    assert read_manifest(packages[fmt]["cb"]).runtime_graph.fusions["live_tokens"] == 1 and "NonZero" in cb
    assert graph.fusions.get("trimmed_rows") == 1 and "live_tokens" not in graph.fusions
    # a tree graph moves q/k/v to their op slots and back (one ScatterND and one GatherND a layer, in place of a Pad
    # and a Slice), and its positions once; the LM head's pick is the other GatherND
    assert graph.fusions.get("tree_attention") == 1
    assert "NonZero" not in plain and plain.count("ScatterND") == 3 and plain.count("GatherND") == 3
    for name in ("0,4", "cb"):  # the vendor graph's KV functions (CtxScatter/CtxGather) went with its attention
        proto = onnx.load(str(packages[fmt][name] / ORT_ONNX_FILE), load_external_data=False)
        assert not proto.functions and {o.domain for o in proto.opset_import} <= {"", "ai.onnx", "com.microsoft"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_package_holds_no_fp32_copy_of_the_model(packages, fmt):
    """An int8/int4 package is its runtime graph alone: every weight in its own data file (none read from
    model.onnx.data, which it does not ship, nor model.onnx), no fp32 table: the embedding is gathered from the
    tied LM head's MatMulNBits blocks (GatherBlockQuantized, as ONNX Runtime GenAI stores it)."""
    package = packages[fmt]["0,4"]
    manifest = read_manifest(package)
    graph = manifest.runtime_graph
    assert (graph.data_file, graph.vendor_data_file) == (ORT_ONNX_FILE + ".data", None)
    assert not manifest.vendor_graph and not (package / ONNX_FILE).exists()
    assert not (package / (ONNX_FILE + ".data")).exists()
    proto = onnx.load(str(package / ORT_ONNX_FILE), load_external_data=False)
    places = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert places == {graph.data_file}
    tables = [
        t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and np.prod(t.dims) >= 320 * 64
    ]
    assert not tables  # no fp32 [vocab, hidden] table (the scales are 1/32 of it)
    [gather] = [node for node in proto.graph.node if node.op_type == "GatherBlockQuantized"]
    reshape = next(node for node in proto.graph.node if node.output[0] == gather.input[0])
    head = next(
        node for node in proto.graph.node if node.op_type == "MatMulNBits" and node.input[1] == reshape.input[0]
    )
    assert gather.input[2] == head.input[2]  # the LM head's blocks and scales
    assert head.attribute and dict((a.name, a.i) for a in head.attribute)["N"] == 320  # [hidden, vocab]
    assert graph.fusions["quantized_tables"] == 1


def test_untied_embedding_is_block_quantized_on_its_own(tiny_model, tmp_path):
    """An untied model's embedding gets its own GatherBlockQuantized table (ONNX Runtime's block quantizer,
    a row per token); speculative greedy still equals plain greedy."""
    package, manifest, _ = compile_format(tiny_model("llama", tie=False), tmp_path / "untied", "0,4", "int4")
    proto = onnx.load(str(package / ORT_ONNX_FILE), load_external_data=False)
    [gather] = [node for node in proto.graph.node if node.op_type == "GatherBlockQuantized"]
    reshape = next(node for node in proto.graph.node if node.output[0] == gather.input[0])
    assert reshape.input[0] == "model.embed_tokens.weight_Q4"
    assert "Gather" not in {node.op_type for node in proto.graph.node if node.input[0] == "model.embed_tokens.weight"}
    assert run(package, PROMPTS, method="pld")[0] == run(package, PROMPTS, method="none")[0]


def test_fp32_runtime_graph_reads_the_vendor_graphs_weights(packages):
    """fp32 stores its weights once: its own (the packed q/k/v weights) are in model.ort.onnx.data, each at
    a page boundary, every other weight is read from model.onnx.data, and the separate q/k/v weights are
    not read."""
    package = packages["fp32"]["0,4"]
    graph = read_manifest(package).runtime_graph
    assert (graph.data_file, graph.vendor_data_file) == (ORT_ONNX_FILE + ".data", ONNX_FILE + ".data")
    proto = onnx.load(str(package / ORT_ONNX_FILE), load_external_data=False)
    own = {
        tensor.name: {entry.key: entry.value for entry in tensor.external_data}
        for tensor in proto.graph.initializer
        if any(entry.value == graph.data_file for entry in tensor.external_data)
    }
    assert {f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)} <= set(own)
    assert all(int(entry["offset"]) % 4096 == 0 for entry in own.values())
    assert matmul_ops(package)["MatMul"] == 2 * 5 + 1  # 2 layers x (qkv, o, gate, up, down) + the LM head
    names = {tensor.name for tensor in proto.graph.initializer}
    assert {f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)} <= names
    assert not any(f".{x}_proj." in name for name in names for x in "qkv")
    places = {
        entry.value for tensor in proto.graph.initializer for entry in tensor.external_data if entry.key == "location"
    }
    assert places == {ONNX_FILE + ".data", ORT_ONNX_FILE + ".data"}
    assert sorted(path.name for path in package.glob("*.data")) == [ONNX_FILE + ".data", ORT_ONNX_FILE + ".data"]


def test_weight_format_is_part_of_the_package_key(model, packages, tmp_path):
    """Compiling another format into an existing package rebuilds it; the same format reuses it."""
    folder = tmp_path / "pkg"
    _, first, reused = compile_format(model, folder, "0,4", "int4")
    assert not reused
    _, again, reused = compile_format(model, folder, "0,4", "int4")
    assert reused and again.inputs_key == first.inputs_key
    _, other, reused = compile_format(model, folder, "0,4", "int8")
    assert not reused and other.inputs_key != first.inputs_key and other.weight_format == "int8"


def test_package_of_an_older_graph_recipe_is_rebuilt(model, tmp_path, monkeypatch):
    """A package built by another runtime-graph recipe (an older qspec) is rebuilt, not reused."""
    from qspec.backends import ort_optimize

    folder = tmp_path / "pkg"
    _, first, _ = compile_format(model, folder, "0,4", "fp32")
    monkeypatch.setattr(ort_optimize, "RECIPE_VERSION", ort_optimize.RECIPE_VERSION + 1)
    _, again, reused = compile_format(model, folder, "0,4", "fp32")
    assert not reused and again.inputs_key != first.inputs_key


def test_qaic_backend_refuses_quantized_weights():
    """The vendor flow compiles the fp32 graph: int4 for qaic is a one-line error naming --mxfp6-matmul."""
    with pytest.raises(ConfigError, match="--mxfp6-matmul"):
        CompileOptions.create(
            specialization=make_config(num_speculative_tokens="0,4"), backend="qaic", weight_format="int4"
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_packages_follow_fp32(packages, fmt):
    """Teacher-forced top-1 agreement with fp32 (random weights of std 0.3: a hard case, logits near ties),
    far above chance (1/320) and not a ranking of recipes: on 4 prompts, symmetric vs asymmetric blocks
    int8 0.93 / 0.94 (llama), 0.98 / 0.94 (qwen2), int4 0.39 / 0.52, 0.35 / 0.37; on the real model
    symmetric blocks follow fp32 as well or better (tests/test_smollm2.py)."""
    report = compare_packages(
        packages["fp32"]["0,4"], packages[fmt]["0,4"], ["abcabc", "hello world"], max_new_tokens=12, chat=False
    )
    assert report.prompts == 2 and report.positions > 20
    assert report.top1_agreement >= (0.85 if fmt == "int8" else 0.3)
    same = compare_packages(
        packages["fp32"]["0,4"], packages["fp32"]["0,1,2,4,8"], ["abcabc"], max_new_tokens=12, chat=False
    )
    assert same.top1_agreement == 1.0 and same.greedy_equal == 1 and same.first_divergence == [None]


def test_teacher_forced_argmax_reproduces_greedy(packages):
    """Reading prompt + greedy output back, the argmax after each prefix is the next greedy token."""
    engine = Engine(packages["fp32"]["0,4"], method="none")
    [out] = engine.generate([PROMPTS[3]], SamplingParams(max_new_tokens=11, ignore_eos=True))
    text = out.prompt_token_ids + out.token_ids
    pred = teacher_forced_argmax(engine.model, text)
    assert pred.shape == (len(text),)
    np.testing.assert_array_equal(pred[len(out.prompt_token_ids) - 1 : -1], out.token_ids)


def test_compile_cli_weight_format(model, tmp_path):
    """`qspec compile --weight-format int4` records the format; an unknown format is a one-line error."""
    from tests.test_cli import assert_one_line_error, qspec

    out = tmp_path / "pkg"
    result = qspec(
        "compile",
        str(model),
        "-k",
        "0,4",
        "--ctx-len",
        "32",
        "--prefill-seq-len",
        "4",
        "--weight-format",
        "int4",
        "-o",
        str(out),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["weight_format"] == "int4"
    assert_one_line_error(
        qspec("compile", str(model), "--weight-format", "int3", "-o", str(tmp_path / "x")),
        "'--weight-format'",
        "'int3' is not one of",
    )
    assert_one_line_error(
        qspec("compile", str(model), "--weight-format", "int8", "--backend", "qaic", "-o", str(tmp_path / "y")),
        "--mxfp6-matmul",
    )


@pytest.mark.parametrize("fmt", ("fp32", *FORMATS))
def test_a_token_gets_the_same_logits_alone_and_in_a_verify_call(packages, fmt):
    """The K=0 call (one token, run as one: the MatMuls see one row) and the first row of a K=4 call give a
    token bit-identical logits. ONNX Runtime's GroupQueryAttention rounds a lone query token otherwise
    (the graph pads it to MIN_QUERY_TOKENS); int8 activations turn that into ~0.5 logits on SmolLM2
    (tests/test_smollm2.py), so without the pad speculative greedy output would not be greedy."""
    from qspec.runtime.model import CompiledModel

    model = CompiledModel(packages[fmt]["0,4"])
    assert model.decode[0].input_ids.shape == (1, 1)  # the one-token call is not widened
    prefill = model.prefill
    prefill.reset()
    prefill.input_ids[0, :6] = PROMPTS[3][:6]
    prefill.position_ids[0, :6] = np.arange(6)
    model.run(prefill)
    logits = {}
    for k, tokens in ((0, [50]), (4, [50, 51, 52, 53, 54])):
        bound = model.decode[k]
        bound.reset()
        bound.input_ids[0, : len(tokens)] = tokens
        bound.position_ids[0, : len(tokens)] = np.arange(6, 6 + len(tokens))
        logits[k] = model.run(bound)[0, 0].copy()
    np.testing.assert_array_equal(logits[0], logits[4])
