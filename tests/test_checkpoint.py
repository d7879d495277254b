"""Streamed export: weights read tensor by tensor from the safetensors checkpoint or the GGUF file, the same
graph and bytes."""

from __future__ import annotations

import weakref

import pytest
import torch

from qspec.export import checkpoint as checkpoint_module
from qspec.export import exporter
from qspec.export.checkpoint import Checkpoint, GGUFCheckpoint
from qspec.export.graph import ExportOptions
from qspec.export.loader import load_skeleton, materialize, resolve_source
from tests.conftest import byte_tokenizer, save_tiny_model, tiny_config

# llama.cpp's architecture name of each family transformers reads from a GGUF.
GGUF_ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3moe",
}


def save_tiny_gguf(path, family: str, *, tie: bool = True, weights: str = "Q4_1", layers: int = 2):
    """A tiny random model of ``family`` written as llama.cpp writes a GGUF: ``weights`` for the matrices,
    Q8_0 for the embedding (as in SmolLM2's Q4_1 file), F32 vectors, q/k permuted for llama."""
    import gguf
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, tie=tie, layers=layers)
    if family == "qwen3":
        config.head_dim = 128  # a qwen3 GGUF gives transformers no head_dim: it takes its default, 128
    if family == "qwen3_moe":  # llama.cpp's qwen3moe: every layer MoE, top-k weights renormalised
        config.mlp_only_layers, config.norm_topk_prob = [], True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    arch = GGUF_ARCH[family]
    writer = gguf.GGUFWriter(path, arch)
    _write_gguf_metadata(writer, config)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    for name, tensor in _llama_cpp_tensors(model.state_dict()):
        if tie and name == "lm_head.weight":
            continue  # a tied GGUF has no output.weight
        base, suffix = name.rsplit(".", 1)
        data = (tensor.detach() * 3 if tensor.dim() > 1 else tensor.detach()).numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores Gemma's (1 + w) norm weights
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):  # llama.cpp's rotary layout
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            data = data.reshape(heads, 2, -1, data.shape[1]).swapaxes(1, 2).reshape(data.shape)
        kind = gguf.GGMLQuantizationType.F32
        if data.ndim > 1:
            kind = gguf.GGMLQuantizationType["Q8_0" if "embed" in name else weights]
        stored = data if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(data, kind)
        gguf_name = f"{names.get_name(base)}.{suffix}" if not base.startswith("blk.") else name
        writer.add_tensor(gguf_name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_tensors(state_dict):
    """``(name, tensor)`` of a state dict, a MoE block's stacked experts as llama.cpp's converter writes them:
    ``experts.gate_up_proj`` ``[experts, 2 * inter, hidden]`` split into ``blk.{i}.ffn_gate_exps.weight`` and
    ``ffn_up_exps.weight``, ``experts.down_proj`` as ``blk.{i}.ffn_down_exps.weight``."""
    for name, tensor in state_dict.items():
        if ".mlp.experts." not in name:
            yield name, tensor
            continue
        block = name.split(".")[2]
        if name.endswith("gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            yield f"blk.{block}.ffn_gate_exps.weight", gate.contiguous()
            yield f"blk.{block}.ffn_up_exps.weight", up.contiguous()
        else:
            yield f"blk.{block}.ffn_down_exps.weight", tensor


def _write_gguf_metadata(writer, config) -> None:
    """The config and a byte-level tokenizer (the test tokenizer's vocabulary) as GGUF metadata."""
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])  # Gemma 3: one per layer type
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    vocab = sorted(byte_tokenizer().get_vocab(), key=byte_tokenizer().get_vocab().get)
    tokens = vocab + [f"<extra_{i}>" for i in range(config.vocab_size - len(vocab) - 1)] + ["ab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)  # else transformers takes the family's default, past this vocabulary


def _export(model, out, *, stream: bool, monkeypatch, options=None, say=None, meta=False):
    """Export ``model`` (folder or .gguf) into ``out`` in this process, streamed or through the in-memory loader."""
    out.mkdir()
    with monkeypatch.context() as patch:
        if not stream:
            patch.setattr(exporter, "load_skeleton", lambda source: None)
        written = exporter._export_into(
            out, resolve_source(model), "digest", "key", options or ExportOptions(), say or (lambda m: None)
        )
    assert written.streamed is stream
    result = (out / "model.onnx").read_bytes(), (out / "model.onnx.data").read_bytes()
    return (*result, written.model) if meta else result


@pytest.mark.parametrize("family,tie", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_streamed_export_is_byte_identical_to_the_in_memory_one(tmp_path, monkeypatch, family, tie):
    """Same graph, same names, same weight bytes as exporting the loaded model (so no EXPORT_FORMAT bump)."""
    folder = save_tiny_model(tmp_path / "m", family, tie=tie, layers=3)
    options = ExportOptions(continuous_batching=True, hidden_states=True)
    streamed = _export(folder, tmp_path / "s", stream=True, monkeypatch=monkeypatch, options=options)
    loaded = _export(folder, tmp_path / "l", stream=False, monkeypatch=monkeypatch, options=options)
    assert streamed == loaded


def test_sharded_bf16_checkpoint_streams_like_it_loads(tmp_path, monkeypatch):
    """A bf16 checkpoint in shards with an index: converted to fp32 as it streams, as from_pretrained converts it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", tie=False, layers=3)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m", max_shard_size="60KB")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / checkpoint_module.SAFE_INDEX).is_file()
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    streamed = _export(tmp_path / "m", tmp_path / "s", stream=True, monkeypatch=monkeypatch)
    loaded = _export(tmp_path / "m", tmp_path / "l", stream=False, monkeypatch=monkeypatch)
    assert streamed == loaded


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_export_reads_each_weight_once_and_holds_one_at_a_time(tmp_path, monkeypatch, kind):
    """The export never materializes all weights: each checkpoint tensor is read once and dropped once written."""
    if kind == "gguf":
        model, source_class = save_tiny_gguf(tmp_path / "m.gguf", "llama", tie=False, layers=6), GGUFCheckpoint
    else:
        model, source_class = save_tiny_model(tmp_path / "m", "llama", tie=False, layers=6), Checkpoint
    reads: dict[str, int] = {}
    live = {"now": 0, "peak": 0}
    read = source_class.read

    def read_once(self, name):
        reads[name] = reads.get(name, 0) + 1
        assert reads[name] == 1, f"{name} read twice"
        tensor = read(self, name)
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(tensor, lambda: live.__setitem__("now", live["now"] - 1))
        return tensor

    load = checkpoint_module.StreamedWeights._load

    def load_tracked(self, name, shape):
        result = load(self, name, shape)
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(result.raw, lambda: live.__setitem__("now", live["now"] - 1))
        return result

    monkeypatch.setattr(source_class, "read", read_once)
    monkeypatch.setattr(checkpoint_module.StreamedWeights, "_load", load_tracked)
    messages: list[str] = []
    _export(model, tmp_path / "s", stream=True, monkeypatch=monkeypatch, say=messages.append)
    skeleton, _, checkpoint = load_skeleton(resolve_source(model))
    assert set(reads) == checkpoint.names  # every tensor, once
    assert live["peak"] <= 2, f"{live['peak']} weights in memory at once"  # the fp32 copy and at most its source
    assert any(m.startswith(f"writing weights: {len(reads)}/{len(reads)} tensors") and "ETA" in m for m in messages)


def test_skeleton_keeps_untraced_layers_on_meta(tmp_path):
    """Only the embedding, norm, head and the listed layers get storage; a tied head stays tied."""
    folder = save_tiny_model(tmp_path / "m", "llama", tie=True, layers=4)
    model, _, checkpoint = load_skeleton(resolve_source(folder))
    assert all(p.is_meta for p in model.parameters())
    materialize(model, [0])
    layers = model.model.layers
    assert not any(p.is_meta for p in layers[0].parameters())
    assert all(p.is_meta for layer in layers[1:] for p in layer.parameters())
    assert not model.model.embed_tokens.weight.is_meta
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {name for name, _ in model.named_parameters()} <= checkpoint.names


def test_checkpoints_that_do_not_stream_fall_back_to_loading(tmp_path):
    """A folder without a model.safetensors (or its index) is loaded whole, as before."""
    folder = save_tiny_model(tmp_path / "m", "llama", layers=2)
    (folder / "model.safetensors").rename(folder / "other.safetensors")
    assert load_skeleton(resolve_source(folder)) is None


@pytest.mark.parametrize(
    "family,tie,weights",
    [("llama", True, "Q4_1"), ("llama", False, "Q8_0"), ("qwen2", False, "Q4_1"), ("qwen3", True, "F16")],
)
def test_streamed_gguf_export_is_byte_identical_to_the_in_memory_one(tmp_path, monkeypatch, family, tie, weights):
    """A GGUF streams through the export: the same graph, weight bytes and model info as transformers' GGUF load."""
    gguf_file = save_tiny_gguf(tmp_path / "m.gguf", family, tie=tie, weights=weights, layers=3)
    options = ExportOptions(continuous_batching=True, hidden_states=True)
    streamed = _export(gguf_file, tmp_path / "s", stream=True, monkeypatch=monkeypatch, options=options, meta=True)
    loaded = _export(gguf_file, tmp_path / "l", stream=False, monkeypatch=monkeypatch, options=options, meta=True)
    assert streamed == loaded


@pytest.mark.parametrize("weights", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "F16", "BF16", "F32"])
def test_gguf_checkpoint_reads_what_transformers_loads(tmp_path, weights):
    """Every parameter read from the GGUF equals, bit for bit, the one transformers' GGUF loader puts in the model."""
    from qspec.export.loader import load_model

    gguf_file = save_tiny_gguf(tmp_path / "m.gguf", "llama", tie=False, weights=weights)
    model, _ = load_model(resolve_source(gguf_file))
    _, _, checkpoint = load_skeleton(resolve_source(gguf_file))
    params = dict(model.named_parameters())
    assert checkpoint.names == set(params)
    for name, param in params.items():
        assert torch.equal(checkpoint.read(name), param.detach()), name


def test_gguf_of_an_architecture_read_another_way_falls_back_to_loading(tmp_path, monkeypatch):
    """A GGUF whose tensors transformers does not convert one at a time is loaded whole, and the export says so."""
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    class Merging(hf_gguf.TensorProcessor):
        """Stands for a processor that merges tensors (as the MoE ones do)."""

    monkeypatch.setitem(hf_gguf.TENSOR_PROCESSORS, "llama", Merging)
    gguf_file = save_tiny_gguf(tmp_path / "m.gguf", "llama")
    assert load_skeleton(resolve_source(gguf_file)) is None
    messages: list[str] = []
    out = tmp_path / "e"
    out.mkdir()
    meta = exporter._export_into(out, resolve_source(gguf_file), "d", "k", ExportOptions(), messages.append)
    assert not meta.streamed
    assert any("cannot be streamed" in m for m in messages)


@pytest.mark.slow
def test_streamed_smollm2_gguf_export_is_byte_identical(tmp_path, monkeypatch):
    """The real SmolLM2 GGUF (Q4_1, Q8_0 and F32 tensors, tied): streamed, the same graph and weight bytes."""
    from tests.test_smollm2 import smollm2_path

    gguf_file = smollm2_path()
    streamed = _export(gguf_file, tmp_path / "s", stream=True, monkeypatch=monkeypatch, meta=True)
    loaded = _export(gguf_file, tmp_path / "l", stream=False, monkeypatch=monkeypatch, meta=True)
    assert streamed == loaded


# mixtral, granite, olmo2 and deepseek_v3 GGUFs transformers does not read.
@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3_text", "qwen3_moe"])
def test_family_gguf_exports_what_transformers_reads(tmp_path, family):
    """A tiny GGUF of a family transformers reads (written as llama.cpp writes it) exports to a graph whose logits
    over a prompt equal those of transformers' own GGUF load within 1e-4 (qwen3_moe: with the expert width
    transformers' config reading leaves out, ``loader.GGUF_CONFIG_GAPS``, as the export reads it)."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from qspec.export import export_model
    from qspec.export.loader import _gguf_read_once
    from tests.test_export import TOL, Graph

    gguf_file = save_tiny_gguf(tmp_path / "m.gguf", family, weights="Q8_0")
    folder, meta = export_model(gguf_file, ExportOptions())
    prompt = np.random.default_rng(3).integers(3, 259, size=6).tolist()
    logits = Graph(folder, meta, rows=1).run([prompt], [list(range(len(prompt)))], keep=len(prompt))[0]
    with _gguf_read_once():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(logits, hf(torch.tensor([prompt])).logits[0].numpy(), atol=TOL)
