"""ONNX Runtime's MoE operator in the runtime graph (qspec.backends.ort_moe): on the exporter's own static MoE
block of transformers' Mixtral and Qwen3-MoE blocks (softmax top-k, the k weights renormalised or not), one
``MoE`` node gives the block's output, and ``QMoE`` reads its int4/int8 experts as the block quantizer wrote them;
DeepSeek-V3's block (group-limited sigmoid routing computed by the graph, shared experts) hands its routing table
to the operator.

The whole families (every layer, the contract's scenarios, greedy output) run in tests/test_export.py and
tests/test_families.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 4, 2


def family_block(family: str, normalize: bool):
    """A transformers MoE block of ``family`` with random weights (top-2 of 4 experts; DeepSeek-V3: of 8 in 4
    groups, 2 groups kept, a random correction bias, one shared expert, weights scaled by 2.5)."""
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    if family == "deepseek_v3":
        config = DeepseekV3Config(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            n_routed_experts=2 * EXPERTS,
            num_experts_per_tok=TOP_K,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            norm_topk_prob=normalize,
            routed_scaling_factor=2.5,
        )
        block = DeepseekV3MoE(config)
        block.gate.e_score_correction_bias.normal_(0, 0.1)
    elif family == "mixtral":
        config = MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
        )
        block = MixtralSparseMoeBlock(config)
    else:
        config = Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            norm_topk_prob=normalize,
        )
        block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.2)
    return block.eval()


def static_graph(block, path):
    """The exporter's static form of ``block`` (:func:`qspec.export.moe.static_moe`, routed by the family's
    router) as layer 0's MLP, named as in an exported model (``model.layers.0.mlp.*``), traced by the dynamo
    exporter without its optimizer as :mod:`qspec.export.trace` traces (the weights keep their names)."""
    from torch import nn

    from qspec.export.moe import group_limited, softmax_top_k, stack_block, static_moe

    router = group_limited if hasattr(block, "shared_experts") else softmax_top_k

    stack_block(block)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = block

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer()])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

        def forward(self, x):
            return static_moe(self.model.layers[0].mlp, x, router)

    x = torch.randn(1, 3, HIDDEN)
    seq = torch.export.Dim("seq", min=1, max=64)
    torch.onnx.export(Model().eval(), (x,), str(path), dynamo=True, dynamic_shapes=({1: seq},), optimize=False)
    return path


def fused(static, target, normalize: bool, bits=None, settings=(32, 0, True), experts=EXPERTS, routing="softmax"):
    """``static`` with its block replaced by :func:`~qspec.backends.ort_moe.fuse_moe`; (path, blocks replaced)."""
    from qspec.backends.ort_moe import fuse_moe
    from qspec.onnx_files import load_model, save_model
    from qspec.package import MoEInfo

    model = load_model(static)
    info = MoEInfo(layers=[0], num_experts=experts, top_k=TOP_K, normalize=normalize, routing=routing)
    count = fuse_moe(model, info, bits=bits, settings=settings)
    save_model(model, target)
    return target, count


def run(path, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0], session


def op_types(session_path) -> list[str]:
    import onnx

    return [node.op_type for node in onnx.load(str(session_path), load_external_data=False).graph.node]


@pytest.mark.parametrize("family,normalize", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_moe_operator_equals_the_family_block(tmp_path, family, normalize):
    """One MoE node in place of the static block: the family block's output within 1e-5 on 1 and 5 tokens
    (softmax top-k; renormalised as Mixtral and Qwen3-MoE ``norm_topk_prob=True``, or not)."""
    block = family_block(family, normalize)
    x = torch.randn(1, 5, HIDDEN)
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
    path, count = fused(static_graph(block, tmp_path / "static.onnx"), tmp_path / "moe.onnx", normalize)
    assert count == 1
    ops = op_types(path)
    assert ops.count("MoE") == 1 and "TopK" not in ops and "Softmax" not in ops
    for tokens in (1, 5):
        got, _ = run(path, x[:, :tokens].numpy())
        np.testing.assert_allclose(got, want[:, :tokens].numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_qmoe_reads_the_block_quantized_experts(tmp_path, bits):
    """QMoE equals the block computed in numpy from the experts it was given dequantized (raw nibbles or bytes
    minus the symmetric zero point, times the block's scale): the layout, the interleaved gate/up rows and the
    routing are read as written. int4 at accuracy level 0 (fp32 activations): within 2e-5; int8 has no fp32
    kernel (its activations are int8 at every level, as a MatMulNBits graph's at qspec's level 4): within 3%
    of the output's norm (a misread layout is off by its whole norm)."""
    from qspec.backends.ort_moe import interleaved_fc1, stacked_fc2

    block = family_block("qwen3_moe", normalize=True)
    x = torch.randn(1, 5, HIDDEN)
    static = static_graph(block, tmp_path / "static.onnx")
    settings = (32, 0, True)  # accuracy level 0: fp32 activations where the kernel has them (int4)
    path, count = fused(static, tmp_path / "qmoe.onnx", True, bits=bits, settings=settings)
    assert count == 1 and op_types(path).count("QMoE") == 1
    got, _ = run(path, x.numpy())
    experts = block.experts
    fc1 = dequantized(interleaved_fc1(experts.up_stacked.detach().numpy(), EXPERTS), bits, settings)  # [e, 2i, h]
    fc2 = dequantized(stacked_fc2(experts.down_stacked.detach().numpy(), EXPERTS), bits, settings)  # [e, h, i]
    tokens = x[0].numpy()
    probs = torch.softmax(torch.from_numpy(tokens) @ block.gate.weight.detach().T, dim=-1).numpy()
    want = np.zeros_like(tokens)
    for t, row in enumerate(probs):
        chosen = np.argsort(-row)[:TOP_K]
        weights = row[chosen] / row[chosen].sum()
        for expert, weight in zip(chosen, weights):
            h = fc1[expert] @ tokens[t]
            gate, up = h[0::2], h[1::2]
            want[t] += weight * (fc2[expert] @ (gate / (1 + np.exp(-gate)) * up))
    if bits == 4:
        np.testing.assert_allclose(got[0], want, atol=2e-5, rtol=1e-4)
    else:
        assert np.linalg.norm(got[0] - want) < 0.03 * np.linalg.norm(want)  # measured: 1.3%


def dequantized(weights, bits: int, settings=(32, 0, True)):
    """``weights`` ``[experts, N, K]`` as :func:`~qspec.backends.ort_moe.quantize_experts` stores them, read back
    (raw nibbles or bytes minus the symmetric zero point, times the block's scale)."""
    from qspec.backends.ort_moe import quantize_experts

    packed, scales = quantize_experts(weights, bits, settings)
    if bits == 4:
        packed = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:2], -1)
    return (packed.astype(np.float32) - (1 << (bits - 1))) * np.repeat(scales, settings[0], axis=-1)


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_operator_takes_deepseek_routing_table(tmp_path, normalize):
    """DeepSeek-V3's block (sigmoid scores plus correction bias, top-2 groups of 4, top-2 of 8 experts, weights
    renormalised or not, times 2.5, one shared expert): its routing stays in the graph and the routed experts
    become one ``MoE`` node fed the table's log (output times the table's sum) within 1e-5 of the transformers
    block on 1 and 5 tokens; the shared expert stays MatMuls."""
    block = family_block("deepseek_v3", normalize)
    x = torch.randn(1, 5, HIDDEN)
    with torch.no_grad():
        want = block(x).numpy()
    static = static_graph(block, tmp_path / "static.onnx")
    path, count = fused(static, tmp_path / "moe.onnx", normalize, experts=2 * EXPERTS, routing="table")
    assert count == 1
    ops = op_types(path)
    assert ops.count("MoE") == 1 and "TopK" in ops and "Sigmoid" in ops  # the routing, computed by the graph
    assert ops.count("MatMul") == 4  # the router's logits and the shared expert's gate, up, down
    for tokens in (1, 5):
        got, _ = run(path, x[:, :tokens].numpy())
        np.testing.assert_allclose(got, want[:, :tokens], atol=1e-5, rtol=1e-5)


def test_qmoe_takes_deepseek_routing_weights(tmp_path):
    """int4 ``QMoE`` with DeepSeek-V3's table as ``router_probs`` and ``router_weights``: the routed experts
    dequantized in numpy, weighed by the table's weights as they are (not renormalised by the operator), plus
    the shared expert, within 2e-5; int8 within 3% of the norm (int8 activations)."""
    from qspec.backends.ort_moe import interleaved_fc1, stacked_fc2
    from qspec.export.moe import group_limited

    block = family_block("deepseek_v3", normalize=True)
    x = torch.randn(1, 5, HIDDEN)
    static = static_graph(block, tmp_path / "static.onnx")
    with torch.no_grad():
        table = group_limited(block.gate, x)[0].numpy()  # [tokens, experts]
        shared = block.shared_experts(x)[0].numpy()
    experts = block.experts
    for bits in (4, 8):
        path, count = fused(static, tmp_path / f"qmoe{bits}.onnx", True, bits=bits, experts=8, routing="table")
        assert count == 1 and op_types(path).count("QMoE") == 1
        got, _ = run(path, x.numpy())
        fc1 = dequantized(interleaved_fc1(experts.up_stacked.detach().numpy(), 8), bits)
        fc2 = dequantized(stacked_fc2(experts.down_stacked.detach().numpy(), 8), bits)
        want = shared.copy()
        for t, row in enumerate(table):
            for expert in np.flatnonzero(row):
                h = fc1[expert] @ x[0, t].numpy()
                gate, up = h[0::2], h[1::2]
                want[t] += row[expert] * (fc2[expert] @ (gate / (1 + np.exp(-gate)) * up))
        assert (np.count_nonzero(table, axis=-1) == TOP_K).all() and abs(table.sum(-1) - 2.5).max() < 1e-5
        if bits == 4:
            np.testing.assert_allclose(got[0], want, atol=2e-5, rtol=1e-4)
        else:
            assert np.linalg.norm(got[0] - want) < 0.03 * np.linalg.norm(want - shared)


def test_asymmetric_quantization_keeps_the_static_form(tmp_path):
    """An asymmetric recipe (zero points QMoE is not given): no block replaced, the graph as it was."""
    block = family_block("mixtral", normalize=True)
    static = static_graph(block, tmp_path / "static.onnx")
    path, count = fused(static, tmp_path / "kept.onnx", True, bits=4, settings=(32, 0, False))
    assert count == 0 and "QMoE" not in op_types(path) and "TopK" in op_types(path)


def test_weight_bytes_count_the_routed_experts_a_token_reads(tmp_path):
    """A graph's weight bytes (the bandwidth floor's numerator) count a ``MoE`` node's experts as the ``k`` of
    them a token reads: top-2 of 4 experts holding 4,096 + 2,048 bytes count 3,072; a MatMul weight counts whole;
    the embedding table (only gathered) not at all."""
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper

    from qspec.backends.ort_optimize import streamed_weight_bytes

    def weight(name, *shape):
        return numpy_helper.from_array(np.zeros(shape, np.float32), name)

    inits = [weight("embed", 10, 8), weight("w", 8, 8), weight("fc1", 4, 32, 8), weight("fc2", 4, 8, 16)]
    nodes = [
        h.make_node("Gather", ["embed", "ids"], ["x"]),
        h.make_node("MatMul", ["x", "w"], ["logits"]),
        h.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=2),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("ids", T.INT64, [1])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        initializer=inits,
    )
    path = tmp_path / "moe.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)]), path)
    assert streamed_weight_bytes(path) == 8 * 8 * 4 + (4 * 32 * 8 + 4 * 8 * 16) * 4 * 2 // 4
