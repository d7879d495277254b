"""One Mixtral MoE block on ONNX Runtime: qspec's static form (every expert on every token) against ONNX Runtime's
``com.microsoft.MoE`` operator (top-k experts only), as the runtime graph would run it.

    nice -n 10 python scripts/moe_op.py [--hidden 256] [--inter 1024] [--experts 8] [--top-k 2] [--calls 300]
    nice -n 10 python scripts/moe_op.py --format int4 [...]

The static form is the exporter's own (:func:`qspec.export.moe.static_moe`, traced by the dynamo exporter); the
operator reads the block's router logits and its experts' weights (gate and up rows interleaved: the layout ONNX
Runtime's CPU kernel takes). ``--format int4``/``int8``: the static form's MatMuls as ``MatMulNBits`` against
``com.microsoft.QMoE``, both as the ort backend quantizes them (:mod:`qspec.backends.ort_quantize`,
:mod:`qspec.backends.ort_moe`). Prints the largest difference from the PyTorch block and the median ms per call
for 1 and 5 tokens, one thread, interleaved calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

PROVIDERS = ["CPUExecutionProvider"]


def mixtral_block(hidden: int, inter: int, experts: int, top_k: int):
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k
    )
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.05)
    return block


def static_graph(block, path: Path) -> Path:
    import torch

    from qspec.export.moe import softmax_top_k, stack_block, static_moe

    stack_block(block)
    layer = torch.nn.Module()
    layer.mlp = block
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList([layer])

    class Static(torch.nn.Module):  # weights named as in an export (model.layers.0.mlp.*), for ort_moe to find
        def __init__(self):
            super().__init__()
            self.model = inner

        def forward(self, x):
            return static_moe(self.model.layers[0].mlp, x, softmax_top_k)

    x = torch.randn(1, 5, block.gate.weight.shape[1])
    seq = torch.export.Dim("seq", min=1, max=64)
    torch.onnx.export(Static().eval(), (x,), str(path), dynamo=True, dynamic_shapes=({1: seq},), optimize=False)
    return path


def quantized_graphs(static: Path, folder: Path, bits: int, experts: int, top_k: int) -> dict[str, Path]:
    """The static form with its MatMuls as MatMulNBits, and the block as one QMoE node (the ort backend's recipe)."""
    from qspec.backends.ort_moe import fuse_moe
    from qspec.backends.ort_optimize import materialize_transposed_weights
    from qspec.backends.ort_quantize import ACCURACY_LEVEL, BLOCK_SIZE, SYMMETRIC, quantize_streamed
    from qspec.onnx_files import load_model, save_model
    from qspec.package import MoEInfo

    plain = load_model(static)
    materialize_transposed_weights(plain)
    quantize_streamed(plain, bits, folder / "plain.onnx.data")
    save_model(plain, folder / "plain.onnx")
    fused = load_model(static)
    info = MoEInfo(layers=[0], num_experts=experts, top_k=top_k, normalize=True)
    fuse_moe(fused, info, bits=bits, settings=(BLOCK_SIZE, ACCURACY_LEVEL, SYMMETRIC))
    materialize_transposed_weights(fused)
    quantize_streamed(fused, bits, folder / "qmoe.onnx.data")  # the router's MatMul, as in the runtime graph
    save_model(fused, folder / "qmoe.onnx")
    return {"static": folder / "plain.onnx", "MoE op": folder / "qmoe.onnx"}


def operator_graph(block, path: Path) -> Path:
    import numpy as np
    import onnx
    from onnx import TensorProto
    from onnx import helper as h
    from onnx import numpy_helper as nh

    gate = block.gate.weight.detach().numpy()  # [experts, hidden]
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [experts, 2 * inter, hidden], gate rows then up rows
    experts, rows, hidden = gate_up.shape
    inter = rows // 2
    interleaved = np.stack([gate_up[:, :inter], gate_up[:, inter:]], axis=2).reshape(experts, rows, hidden)
    inits = [
        nh.from_array(np.ascontiguousarray(gate.T), "router"),
        nh.from_array(np.ascontiguousarray(interleaved), "fc1"),
        nh.from_array(block.experts.down_proj.detach().numpy(), "fc2"),
        nh.from_array(np.array([-1, hidden], np.int64), "flat"),
    ]
    nodes = [
        h.make_node("Shape", ["x"], ["shape"]),
        h.make_node("Reshape", ["x", "flat"], ["tokens"]),
        h.make_node("MatMul", ["tokens", "router"], ["logits"]),
        h.make_node(
            "MoE",
            ["tokens", "logits", "fc1", "", "fc2"],
            ["mixed"],
            domain="com.microsoft",
            k=block.gate.top_k,
            activation_type="swiglu",
            swiglu_fusion=1,
            normalize_routing_weights=1,
            activation_alpha=1.0,
            activation_beta=0.0,
        ),
        h.make_node("Reshape", ["mixed", "shape"], ["y"]),
    ]
    x = h.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", hidden])
    y = h.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", hidden])
    graph = h.make_graph(nodes, "moe", [x], [y], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
    return path


def main() -> None:
    import numpy as np
    import onnxruntime as ort
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--format", default="fp32", choices=["fp32", "int8", "int4"])
    args = parser.parse_args()
    block = mixtral_block(args.hidden, args.inter, args.experts, args.top_k)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    with tempfile.TemporaryDirectory() as tmp:
        static = static_graph(block, Path(tmp) / "s.onnx")
        if args.format == "fp32":
            paths = {"static": static, "MoE op": operator_graph(block, Path(tmp) / "o.onnx")}
        else:
            bits = {"int8": 8, "int4": 4}[args.format]
            paths = quantized_graphs(static, Path(tmp), bits, args.experts, args.top_k)
        sessions = {k: ort.InferenceSession(str(p), options, providers=PROVIDERS) for k, p in paths.items()}
        print(
            f"hidden {args.hidden}, inter {args.inter}, top {args.top_k} of {args.experts} experts, {args.format}, "
            f"1 thread, load average {os.getloadavg()[0]:.1f}\n"
        )
        print("| tokens | max diff static | max diff MoE op | ms static | ms MoE op | static / MoE op |")
        print("|---:|---:|---:|---:|---:|---:|")
        for tokens in (1, 5):
            x = torch.randn(1, tokens, args.hidden)
            with torch.no_grad():
                want = block(x).numpy()
            feeds = {"x": x.numpy()}
            diffs = {kind: float(np.abs(s.run(None, feeds)[0] - want).max()) for kind, s in sessions.items()}
            times = {kind: [] for kind in sessions}
            for _ in range(args.calls):
                for kind, session in sessions.items():
                    begin = time.perf_counter()
                    session.run(None, feeds)
                    times[kind].append(time.perf_counter() - begin)
            ms = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
            print(
                f"| {tokens} | {diffs['static']:.1e} | {diffs['MoE op']:.1e} | {ms['static']:.3f} | "
                f"{ms['MoE op']:.3f} | {ms['static'] / ms['MoE op']:.2f}x |"
            )


if __name__ == "__main__":
    main()
