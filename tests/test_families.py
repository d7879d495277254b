"""The families beyond Llama end to end, each on a tiny random model of transformers' own class: greedy
`none`, `pld` and a random EAGLE head equal transformers, the int8/int4 runtime graphs keep speculative
greedy output with the fusions the family admits, and `--backend qaic` writes its files.

Export parity on the contract's scenarios runs in tests/test_export.py (its FAMILIES include these)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qspec.compile import CompileOptions, compile_package
from qspec.specializations import make_config
from tests.test_runtime import PROMPTS, run

torch = pytest.importorskip("torch")

FAMILIES = ("phi3", "granite", "olmo2", "gemma2", "gemma3_text", "mixtral", "qwen3_moe", "deepseek_v3")
FAKE_COMPILER = Path(__file__).parent / "fake_qaic" / "qaic-compile"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def built(tiny_model, tmp_path_factory):
    """Factory: ``built(family)`` -> (model folder, {fp32, int8, int4, qaic: package}), all with one random
    EAGLE head and K in [0, 4] over one export; cached per family."""
    cache = {}

    def make(family: str):
        if family not in cache:
            cache[family] = _build(tiny_model(family), tmp_path_factory.mktemp(family))
        return cache[family]

    return make


def _build(model_dir: Path, root: Path):
    from transformers import AutoModelForCausalLM

    from qspec.heads import modules
    from tests.test_heads_modules import randomize

    target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    modules.save_eagle(randomize(modules.eagle_from_target(target)), root / "head")
    spec = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=64)
    packages = {}
    for name, fmt in (("fp32", "fp32"), ("int8", "int8"), ("int4", "int4")):
        options = CompileOptions(specialization=spec, weight_format=fmt, draft_head=str(root / "head"))
        packages[name] = compile_package(model_dir, options, output=root / name)[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QAIC_COMPILE", str(FAKE_COMPILER))
        options = CompileOptions.create(specialization=spec, backend="qaic", draft_head=str(root / "head"))
        packages["qaic"] = compile_package(model_dir, options, output=root / "qaic")[0]
    return model_dir, packages


def transformers_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        # no EOS: the engine runs with ignore_eos, so an EOS the model picks is a token like any other (min_new_tokens
        # would instead forbid it, and the next best token would follow)
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
        outs.append(out[0, len(prompt) :].tolist())
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_none_pld_and_eagle_equal_transformers(built, family):
    """fp32: `none` equals transformers' greedy generate; `pld` and a random EAGLE head (every draft verified)
    equal `none`, token for token."""
    model_dir, packages = built(family)
    plain, _ = run(packages["fp32"], PROMPTS, n=NEW_TOKENS, method="none")
    assert plain == transformers_greedy(model_dir, PROMPTS, NEW_TOKENS)
    for method in ("pld", "eagle"):
        spec, engine = run(packages["fp32"], PROMPTS, n=NEW_TOKENS, method=method, dispatch="cover")
        assert spec == plain, method
        assert engine.last_metrics.proposed > 0, method


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_runtime_graph_keeps_greedy_output(built, family, fmt):
    """int8/int4: every MatMul weight is MatMulNBits, attention is fused where the family admits it, and `pld`
    and the EAGLE head give `none`'s tokens of the same package."""
    from qspec.package import read_manifest

    _, packages = built(family)
    manifest = read_manifest(packages[fmt])
    graph = manifest.runtime_graph
    assert graph.quantized_matmuls > 0 and graph.weight_format == fmt
    fused = graph.fusions.get("group_query_attention", 0)
    assert fused == (manifest.model.num_layers if manifest.model.attention is not None else 0)
    plain, _ = run(packages[fmt], PROMPTS, n=NEW_TOKENS, method="none")
    for method in ("pld", "eagle"):
        assert run(packages[fmt], PROMPTS, n=NEW_TOKENS, method=method, dispatch="cover")[0] == plain, method


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_runtime_graph_runs_the_experts_as_the_moe_operator(built, family, fmt):
    """Every MoE layer is one ``com.microsoft.MoE`` node in the fp32 runtime graph, one ``QMoE`` in int8/int4:
    Mixtral's and Qwen3-MoE's routed by the operator (no TopK of the static form left), DeepSeek-V3's routed by
    its group-limited routing left in the graph (its TopKs: groups, then experts), which feeds the operator its
    table. The vendor graph (the qaic package's) keeps the static form. The fp32 package holds each expert once
    (the runtime graph's own data file, no vendor data beside it). Greedy output: the tests above."""
    import onnx

    from qspec.package import ONNX_FILE, read_manifest

    _, packages = built(family)
    manifest = read_manifest(packages[fmt])
    graph = manifest.runtime_graph

    def op_types(path) -> list[str]:
        return [node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node]

    ops = op_types(packages[fmt] / graph.file)
    moe = manifest.model.moe
    dense = {"qwen3_moe": 1, "deepseek_v3": 0}.get(family)  # qwen3: mlp_only_layers; deepseek: first_k_dense_replace
    layers = [i for i in range(manifest.model.num_layers) if i != dense]
    op = "MoE" if fmt == "fp32" else "QMoE"
    assert moe.routing == ("table" if family == "deepseek_v3" else "softmax")
    assert moe.layers == layers and moe.normalize == (family != "qwen3_moe")  # the tests' qwen3: norm_topk_prob off
    assert graph.fusions["moe"] == len(layers) and ops.count(op) == len(layers)
    vendor = op_types(packages["qaic"] / ONNX_FILE)
    assert "MoE" not in vendor and "QMoE" not in vendor
    if family == "deepseek_v3":  # the routing left whole: per group, the groups, the experts (6 TopKs a layer)
        assert ops.count("TopK") == vendor.count("TopK") == 6 * len(layers)
    else:
        assert "TopK" not in ops and vendor.count("TopK") == len(layers)
    if fmt == "fp32":  # its own data file holds every weight it reads, each expert once: no vendor data shipped
        assert graph.vendor_data_file is None and not (packages[fmt] / (ONNX_FILE + ".data")).exists()
        vendor_bytes = (packages["qaic"] / (ONNX_FILE + ".data")).stat().st_size
        assert (packages[fmt] / graph.data_file).stat().st_size < 1.1 * vendor_bytes


@pytest.mark.parametrize("family", FAMILIES)
def test_qaic_backend_writes_its_files(built, family):
    """--backend qaic through the stand-in compiler: custom IO for every layer's KV (DeepSeek-V3's compressed
    latent cache by QEfficient's names), the QPC, the head's program."""
    from qspec.package import read_manifest

    _, packages = built(family)
    package = packages["qaic"]
    manifest = read_manifest(package)
    assert manifest.qaic is not None and manifest.qaic.ran
    custom_io = (package / "custom_io.yaml").read_text()
    for name in manifest.model.kv_names():  # DeepSeek-V3: compressed_kv.{i}, k_pe.{i} (QEfficient's names)
        assert f"IOName: {name}\n" in custom_io and f"IOName: {name}_RetainedState\n" in custom_io
    if family == "deepseek_v3":
        assert "IOName: compressed_kv.1\n" in custom_io and "IOName: k_pe.1_RetainedState\n" in custom_io
        assert "past_key" not in custom_io
    assert (package / "head" / "qpc" / "programqpc.bin").is_file()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_static_moe_equals_the_family_block(tiny_model, family):
    """Every MoE block, experts stacked and routed by the family's router (softmax top-k, normalised or not;
    DeepSeek-V3's group-limited sigmoid routing with its correction bias, plus shared experts), equals the
    transformers block on random tokens within 1e-5."""
    from transformers import AutoModelForCausalLM

    from qspec.export.adapters import adapter_for
    from qspec.export.moe import is_moe, stack_block, static_moe

    model = AutoModelForCausalLM.from_pretrained(tiny_model(family), dtype=torch.float32).eval()
    router = adapter_for(model.config).router
    blocks = [layer.mlp for layer in model.model.layers if is_moe(layer.mlp)]
    assert blocks
    x = torch.randn(2, 7, model.config.hidden_size)
    for block in blocks:
        with torch.no_grad():
            want = block(x)
            stack_block(block)
            torch.testing.assert_close(static_moe(block, x, router), want, atol=1e-5, rtol=1e-5)
