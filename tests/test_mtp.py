"""MTP layers shipped in the target's checkpoint (qspec.heads.mtp): reading each naming, the torch module and the
ONNX graph of each layer against a reference forward written from vLLM's published code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qspec import contract
from qspec.errors import ConfigError
from tests.mtp_checkpoints import reference_mtp, save_mtp_model

CASES = [("deepseek", 1, "llama"), ("deepseek", 2, "llama"), ("mimo", 1, "qwen2"), ("mimo", 2, "qwen2")]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """Factory: ``mtp_model(layout, num_mtp, family)`` -> a saved tiny target with MTP layers (cached)."""
    made = {}

    def make(layout: str, num_mtp: int, family: str):
        key = (layout, num_mtp, family)
        if key not in made:
            made[key] = save_mtp_model(
                tmp_path_factory.mktemp(f"{layout}{num_mtp}"), layout, num_mtp=num_mtp, family=family
            )
        return made[key]

    return make


def _inputs(hidden_size: int, steps: int = 6, batch: int = 2, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (batch, steps), generator=generator)
    hidden = torch.randn(batch, steps, hidden_size, generator=generator)
    positions = torch.arange(steps).repeat(batch, 1)
    return ids, hidden, positions


@pytest.mark.parametrize(("layout", "num_mtp", "family"), CASES)
def test_find_mtp_reads_each_naming(mtp_model, layout, num_mtp, family):
    """The layout and the number of layers come from the checkpoint's names and ``num_nextn_predict_layers``."""
    from qspec.heads.mtp import find_mtp

    source = find_mtp(mtp_model(layout, num_mtp, family))
    assert (source.layout, source.num_layers) == (layout, num_mtp)
    want = "model.layers.{}." if layout == "deepseek" else "model.mtp_layers.{}."
    offset = 2 if layout == "deepseek" else 0  # the tiny targets have 2 layers
    assert source.prefixes == tuple(want.format(offset + i) for i in range(num_mtp))


def test_find_mtp_without_layers_is_one_line_error(tiny_model):
    """A checkpoint without MTP layers: one line that names the fix."""
    from qspec.heads.mtp import find_mtp

    with pytest.raises(ConfigError) as error:
        find_mtp(tiny_model("llama"))
    message = str(error.value)
    assert "has no MTP layers" in message and "drop --mtp" in message and "\n" not in message


@pytest.mark.parametrize(("layout", "num_mtp", "family"), CASES)
def test_mtp_module_equals_reference(mtp_model, layout, num_mtp, family):
    """Every layer's (feature, logits) equal the reference forward over 6 teacher-forced steps (<= 1e-4)."""
    from qspec.heads.mtp import load_mtp

    folder = mtp_model(layout, num_mtp, family)
    head, _ = load_mtp(folder)
    ids, hidden, positions = _inputs(head.config.hidden_size)
    for layer in range(num_mtp):
        want_feature, want_logits = reference_mtp(folder, layout, layer, ids, hidden, positions)
        with torch.no_grad():
            feature, logits = head(ids, hidden, positions, layer)
        assert torch.allclose(feature, want_feature, atol=1e-4), (feature - want_feature).abs().max()
        assert torch.allclose(logits, want_logits, atol=1e-4), (logits - want_logits).abs().max()


@pytest.mark.parametrize(("layout", "num_mtp", "family"), CASES)
def test_mtp_graph_equals_reference(mtp_model, tmp_path, layout, num_mtp, family):
    """Each layer's ONNX graph in ONNX Runtime: a 5-token call then a 1-token call on its KV give the reference's
    last rows over 5 and 6 steps (<= 1e-4)."""
    import onnxruntime as ort

    from qspec.heads import export
    from qspec.heads.mtp import load_mtp
    from qspec.heads.mtp_export import head_dim, trace_mtp

    folder = mtp_model(layout, num_mtp, family)
    head, _ = load_mtp(folder)
    ids, hidden, positions = _inputs(head.config.hidden_size)
    for layer in range(num_mtp):
        path = tmp_path / f"layer{layer}.onnx"
        export.save(trace_mtp(head, layer, continuous_batching=False), path)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        kv = np.zeros((2, head.config.num_key_value_heads, 16, head_dim(head)), np.float32)
        first = {
            contract.INPUT_IDS: ids[:, :5].numpy(),
            contract.POSITION_IDS: positions[:, :5].numpy(),
            contract.HIDDEN_STATES: hidden[:, :5].numpy(),
            "past_key.0": kv,
            "past_value.0": kv,
        }
        logits, feature, keys, values = session.run(None, first)
        second = first | {
            contract.INPUT_IDS: ids[:, 5:].numpy(),
            contract.POSITION_IDS: positions[:, 5:].numpy(),
            contract.HIDDEN_STATES: hidden[:, 5:].numpy(),
            "past_key.0": keys,
            "past_value.0": values,
        }
        logits2, feature2, _, _ = session.run(None, second)
        want_feature, want_logits = reference_mtp(folder, layout, layer, ids, hidden, positions)
        for got, want in ((feature, want_feature[:, 4:5]), (logits, want_logits[:, 4:5])):
            np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
        for got, want in ((feature2, want_feature[:, 5:6]), (logits2, want_logits[:, 5:6])):
            np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
