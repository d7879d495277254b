"""Target taps for EAGLE-3: a package compiled with an EAGLE-3 head hands the head ``fc(cat(residual streams))``
as its ``hidden_states`` (vendor graph and runtime graph), with the target's logits bitwise those of the package
without taps."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from qspec import contract  # noqa: E402
from qspec.compile import CompileOptions, compile_package  # noqa: E402
from qspec.export.taps import FC_WEIGHT  # noqa: E402
from qspec.specializations import make_config  # noqa: E402
from tests.test_heads_eagle3 import write_eagle3_head  # noqa: E402

TAPS = [3, 0, 1]  # as a config may list them; vLLM collects them in layer order: 0 (the embeddings), 1, 3
PROMPT = [5, 17, 3, 99, 250, 18, 44, 61, 7, 7, 120, 33, 2]  # two prefill chunks of 8


@pytest.fixture(scope="module")
def packages(tiny_model, tmp_path_factory):
    """A 4-layer untied target compiled plainly and with an EAGLE-3 head that taps layers 0, 1 and 3."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("taps")
    model_dir = tiny_model("llama", tie=False, layers=4)
    target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    head = write_eagle3_head(root / "head", target.config, draft_ids=[4, 9, 2, 130, 77], layer_ids=TAPS)
    spec = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=64)
    plain = CompileOptions(specialization=spec, vendor_graph=True)  # model.onnx too: both graphs are checked
    plain = compile_package(model_dir, plain, output=root / "plain")[0]
    options = CompileOptions(
        specialization=spec, vendor_graph=True, draft_head=str(head), draft_head_weight_format="fp32"
    )
    tapped = compile_package(model_dir, options, output=root / "tapped")[0]
    return target, head, plain, tapped


def fc_of(head) -> np.ndarray:
    from safetensors.torch import load_file

    return load_file(str(head / "model.safetensors"))["fc.weight"].float().numpy()


def prefill(package):
    """``(logits after each chunk, hidden states of every position)`` of PROMPT in the runtime graph."""
    from qspec.runtime.load import load_model
    from qspec.runtime.prefill import PrefillRow, run_prefill

    model = load_model(package)
    logits, hidden = [], {}
    run_prefill(
        model,
        [PrefillRow(0, PROMPT)],
        lambda i, values: logits.append(np.array(values)),
        lambda i, start, values: hidden.__setitem__(start, np.array(values, np.float32)),
    )
    states = np.concatenate([hidden[s] for s in sorted(hidden)])[: len(PROMPT)] if hidden else None
    return logits, states


def vendor_logits(package) -> np.ndarray:
    """The vendor graph (model.onnx) on PROMPT's first 8 tokens: logits of the last 5 positions."""
    session = ort.InferenceSession(str(package / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {}
    for value in session.get_inputs():
        if value.name == contract.INPUT_IDS:
            feeds[value.name] = np.asarray([PROMPT[:8]], np.int64)
        elif value.name == contract.POSITION_IDS:
            feeds[value.name] = np.arange(8, dtype=np.int64)[None]
        elif value.name == contract.NUM_LOGITS_TO_KEEP:
            feeds[value.name] = np.zeros((5, 1), np.int64)
        else:  # the KV buffers: [1, kv_heads, ctx_len, head_dim]
            feeds[value.name] = np.zeros([1, value.shape[1], 64, value.shape[3]], np.float32)
    outputs = session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    return outputs[names.index(contract.LOGITS)], dict(zip(names, outputs)).get(contract.HIDDEN_STATES)


def test_fc_is_folded_into_both_graphs(packages):
    """model.onnx and model.ort.onnx: the tap outputs are gone, ``hidden_states`` follows the logits, made by
    Concat and a MatMul with the head's fc (input-major)."""
    import onnx
    from onnx import numpy_helper

    _, head, _, tapped = packages
    for name in ("model.onnx", "model.ort.onnx"):
        graph = onnx.load(str(tapped / name), load_external_data=False).graph
        outputs = [o.name for o in graph.output]
        assert outputs[:2] == [contract.LOGITS, contract.HIDDEN_STATES], name
        assert not [o for o in outputs if o.startswith("tap.")], name
        concat = next(n for n in graph.node if n.name == "taps.concat")
        assert list(concat.input) == ["tap.0", "tap.1", "tap.3"]
        weight = next(t for t in graph.initializer if t.name == FC_WEIGHT)
        np.testing.assert_array_equal(numpy_helper.to_array(weight), fc_of(head).T)


def test_hidden_states_are_fc_of_the_residual_streams(packages):
    """The runtime graph's hidden_states equal fc(cat(output_hidden_states[0], [1], [3])) of the HF model, and so
    do the vendor graph's."""
    target, head, _, tapped = packages
    with torch.no_grad():
        states = target(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in sorted(TAPS)], -1).numpy() @ fc_of(head).T
    _, hidden = prefill(tapped)
    np.testing.assert_allclose(hidden, want, rtol=1e-4, atol=1e-4)
    _, vendor_hidden = vendor_logits(tapped)
    np.testing.assert_allclose(vendor_hidden[0], want[:8], rtol=1e-4, atol=1e-4)


def test_logits_are_bitwise_those_without_taps(packages):
    """The tapped package's logits equal the plain package's bit for bit, in the runtime and the vendor graph."""
    _, _, plain, tapped = packages
    for got, want in zip(prefill(tapped)[0], prefill(plain)[0], strict=True):
        assert np.array_equal(got, want)
    assert np.array_equal(vendor_logits(tapped)[0], vendor_logits(plain)[0])
