"""Streamed export: weights read tensor by tensor from the safetensors checkpoint, the same graph and bytes."""

from __future__ import annotations

import weakref

import pytest
import torch

from qspec.export import checkpoint as checkpoint_module
from qspec.export import exporter
from qspec.export.checkpoint import Checkpoint
from qspec.export.graph import ExportOptions
from qspec.export.loader import load_skeleton, materialize, resolve_source
from tests.conftest import byte_tokenizer, save_tiny_model, tiny_config


def _export(folder, out, *, stream: bool, monkeypatch, options=None, say=None):
    """Export ``folder`` into ``out`` in this process, streamed or through the in-memory loader."""
    out.mkdir()
    with monkeypatch.context() as patch:
        if not stream:
            patch.setattr(exporter, "load_skeleton", lambda source: None)
        meta = exporter._export_into(
            out, resolve_source(folder), "digest", "key", options or ExportOptions(), say or (lambda m: None)
        )
    assert meta.streamed is stream
    return (out / "model.onnx").read_bytes(), (out / "model.onnx.data").read_bytes()


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


def test_export_reads_each_weight_once_and_holds_one_at_a_time(tmp_path, monkeypatch):
    """The export never materializes all weights: each checkpoint tensor is read once and dropped once written."""
    folder = save_tiny_model(tmp_path / "m", "llama", tie=False, layers=6)
    reads: dict[str, int] = {}
    live = {"now": 0, "peak": 0}
    read = Checkpoint.read

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

    monkeypatch.setattr(Checkpoint, "read", read_once)
    monkeypatch.setattr(checkpoint_module.StreamedWeights, "_load", load_tracked)
    messages: list[str] = []
    _export(folder, tmp_path / "s", stream=True, monkeypatch=monkeypatch, say=messages.append)
    assert set(reads) == Checkpoint.find(folder).names  # every tensor, once
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
