"""Per model family: nodes of the ort backend's fp32 runtime graph, fused and unfused, and a one-token call's time.

    nice -n 10 python scripts/family_calls.py [--families phi3,gemma2] [--layers 8] [--hidden 256] [--calls 200]
    nice -n 10 python scripts/family_calls.py --moe --families mixtral --format int4
    nice -n 10 python scripts/family_calls.py --moe --families deepseek_v3 --format int4 --expert-width 1024
    nice -n 10 python scripts/family_calls.py --mla --hidden 512 --layers 4

Each family is a random model of transformers' own class (no download) at ``--hidden`` width and ``--layers``
layers, the family's own settings from ``tests/conftest.py``. Its export is turned into two runtime graphs:
**unfused** (RMSNorm fusions only, attention as exported) and **fused** (attention as ONNX Runtime's
``GroupQueryAttention`` where the family admits it, the experts as ONNX Runtime's ``MoE``: the ort backend's
graph). With ``--moe`` (MoE families), the two graphs are the ort backend's graph in ``--format`` with the
experts in the plain static form (two MatMuls, ``MatMulNBits`` in int8/int4) and with ONNX Runtime's ``MoE``
(``QMoE`` in int8/int4), attention fused in both (where the family admits it); ``--expert-width`` sets
``moe_intermediate_size`` (Qwen3-MoE, DeepSeek-V3; Mixtral's experts are ``intermediate_size``, 4 x hidden).
A one-token decode call at position ``ctx - 8`` of a ``--ctx`` buffer is timed on each, interleaved, one thread;
medians are printed as a markdown table (nodes, ms per call, unfused/fused).

With ``--mla`` (DeepSeek-V3 alone), the two graphs are the ort backend's fp32 graph of the export with the
expanded per-head cache (``ExportOptions(latent_cache=False)``, QEfficient's default) and with the compressed
latent cache (QEfficient's ``cache_compressed``, ``kv_b_proj`` absorbed); the model's attention is set to
DeepSeek-V3's proportions at ``--hidden`` (heads of 32 + 16 RoPE features, values 32 wide, ``kv_lora_rank`` 4x
the head, ``q_lora_rank`` 3x that), and the table gives the KV cache's bytes per token (fp32, all layers) beside
the call times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FAMILIES = "llama,phi3,granite,olmo2,gemma2,gemma3_text,mixtral,qwen3_moe,deepseek_v3"


def build_model(
    family: str, folder: Path, *, layers: int, hidden: int, mla: bool = False, expert_width: int | None = None
) -> Path:
    """A random ``family`` model (the tests' settings) at ``hidden`` width: heads of 32, 2 query heads per KV head;
    experts ``expert_width`` wide where the family sets ``moe_intermediate_size``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from tests.conftest import FAMILY_SETTINGS, VOCAB, byte_tokenizer

    heads = hidden // 32
    settings = dict(FAMILY_SETTINGS.get(family, {}))
    latent = "kv_lora_rank" in settings  # DeepSeek's MLA: every head keeps its key and value; RoPE width as set
    settings |= dict(num_attention_heads=heads, num_key_value_heads=heads if latent else heads // 2)
    if latent and mla:  # DeepSeek-V3's proportions (nope 128, rope 64, v 128, kv_lora 512, q_lora 1536), halved 4x
        settings |= dict(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kv_lora_rank=128, q_lora_rank=384)
    if expert_width and "moe_intermediate_size" in settings:
        settings["moe_intermediate_size"] = expert_width
    if "head_dim" in settings and not latent:
        settings["head_dim"] = 32
    if "layer_types" in settings:  # the tests' pattern (Gemma 3: local, global), repeated over the layers
        pattern = settings["layer_types"]
        settings["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    config = AutoConfig.for_model(
        family,
        **{
            **dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers),
            **dict(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2),
            **settings,
        },
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


class Call:
    """One-token decode calls on one graph, KV bound in place as the runtime binds it."""

    def __init__(self, path: Path, info, ctx: int, slack: int):
        import numpy as np
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        shape = (1, info.num_kv_heads, ctx + slack)
        self.kv = {
            name: ort.OrtValue.ortvalue_from_numpy(np.zeros((*shape, width), np.float32))
            for name, width in zip(info.kv_names(), info.kv_widths())
        }
        self.position = ctx - 8
        self.names = {value.name for value in self.session.get_inputs()}

    def __call__(self) -> float:
        import numpy as np

        from qspec import contract
        from qspec.backends import ort_plan

        positions = np.array([[self.position]], np.int64)
        feeds = {contract.INPUT_IDS: np.array([[7]], np.int64), contract.POSITION_IDS: positions}
        feeds[contract.NUM_LOGITS_TO_KEEP] = np.zeros((1, 1), np.int64)
        feeds |= ort_plan.feeds(positions, 1, self.names)
        binding = self.session.io_binding()
        for name, value in feeds.items():
            if name in self.names:
                binding.bind_cpu_input(name, value)
        for name, value in self.kv.items():
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(contract.retained(name), value)
        binding.bind_output(contract.LOGITS)
        begin = time.perf_counter()
        self.session.run_with_iobinding(binding)
        return time.perf_counter() - begin


def measure(family: str, work: Path, args) -> dict:
    import onnx

    from qspec.backends.ort_optimize import cached_runtime_graph
    from qspec.export import ExportOptions, export_model

    model = build_model(family, work / family, layers=args.layers, hidden=args.hidden, expert_width=args.expert_width)
    folder, meta = export_model(model, ExportOptions())
    attention, moe = meta.model.attention, meta.model.moe
    variants = (("unfused", None, None), ("fused", attention, moe))
    if args.moe:
        variants = (("unfused", attention, None), ("fused", attention, moe))  # plain experts; the MoE operator
    graphs = {}
    for kind, info, experts in variants:
        if kind == "fused" and experts is None and (info is None or args.moe):  # nothing fused
            continue
        graph_dir, runtime = cached_runtime_graph(
            folder, meta.key, args.format, attention=info, positions=args.ctx + 16, moe=experts
        )
        vendor_data = graph_dir / "model.onnx.data"  # the fp32 graph reads the export's weights beside it
        if vendor_data.name in (runtime.vendor_data_file, runtime.data_file) and not vendor_data.exists():
            os.link(folder / "model.onnx.data", vendor_data)
        nodes = len(onnx.load(str(graph_dir / runtime.file), load_external_data=False).graph.node)
        graphs[kind] = (nodes, Call(graph_dir / runtime.file, meta.model, args.ctx, runtime.kv_slack(1)))
    times = {kind: [] for kind in graphs}
    for _ in range(args.calls):
        for kind, (_, call) in graphs.items():
            times[kind].append(call())
    row = {"family": family, "gqa": attention is not None}
    for kind, (nodes, _) in graphs.items():
        row[f"{kind}_nodes"] = nodes
        row[f"{kind}_ms"] = statistics.median(times[kind]) * 1e3
    return row


def measure_mla(work: Path, args) -> dict:
    """DeepSeek-V3's one-token call with the expanded per-head cache and with the compressed latent cache."""
    import onnx

    from qspec.backends.ort_optimize import cached_runtime_graph
    from qspec.export import ExportOptions, export_model

    model = build_model("deepseek_v3", work / "deepseek_v3", layers=args.layers, hidden=args.hidden, mla=True)
    graphs = {}
    for kind, latent in (("expanded", False), ("compressed", True)):
        folder, meta = export_model(model, ExportOptions(latent_cache=latent))
        graph_dir, runtime = cached_runtime_graph(folder, meta.key, "fp32", positions=args.ctx + 16)
        vendor_data = graph_dir / "model.onnx.data"
        if vendor_data.name in (runtime.vendor_data_file, runtime.data_file) and not vendor_data.exists():
            os.link(folder / "model.onnx.data", vendor_data)
        nodes = len(onnx.load(str(graph_dir / runtime.file), load_external_data=False).graph.node)
        info = meta.model
        cache = 4 * info.num_kv_heads * sum(info.kv_widths())  # fp32 bytes per token, every layer
        graphs[kind] = (nodes, cache, Call(graph_dir / runtime.file, info, args.ctx, runtime.kv_slack(1)))
    times = {kind: [] for kind in graphs}
    for _ in range(args.calls):
        for kind, (*_, call) in graphs.items():
            times[kind].append(call())
    return {kind: (nodes, cache, statistics.median(times[kind]) * 1e3) for kind, (nodes, cache, _) in graphs.items()}


def print_mla(result: dict) -> None:
    print("| DeepSeek-V3 cache | nodes | KV bytes per token | ms per call |")
    print("|---|---:|---:|---:|")
    for kind, (nodes, cache, ms) in result.items():
        print(f"| {kind} | {nodes} | {cache:,} | {ms:.3f} |")
    (_, wide, slow), (_, narrow, fast) = result["expanded"], result["compressed"]
    print(f"\nexpanded / compressed: {wide / narrow:.1f}x the cache bytes, {slow / fast:.2f}x the call time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=DEFAULT_FAMILIES)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--moe", action="store_true", help="plain experts against ONNX Runtime's MoE operator")
    parser.add_argument("--format", default="fp32", choices=["fp32", "int8", "int4"])
    parser.add_argument("--expert-width", type=int, help="moe_intermediate_size (default: the tests' settings)")
    parser.add_argument("--mla", action="store_true", help="DeepSeek-V3: expanded against compressed latent cache")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("QSPEC_CACHE_DIR", str(Path(tmp) / "cache"))
        if args.mla:
            result = measure_mla(Path(tmp), args)
        else:
            rows = [measure(family, Path(tmp), args) for family in args.families.split(",")]
    print(
        f"layers {args.layers}, hidden {args.hidden}, ctx {args.ctx}, {args.format}, 1 thread, "
        f"expert width {args.expert_width or 'as the tests'}, "
        f"median of {args.calls} calls, load average {load:.1f} at the start\n"
    )
    if args.mla:
        print_mla(result)
        return
    if args.moe:
        print("unfused: experts as plain MatMuls; fused: ONNX Runtime's MoE operator (attention fused in both)\n")
    print("| family | GQA | nodes unfused | nodes fused | ms unfused | ms fused | unfused / fused |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        fused = (r.get("fused_nodes", "-"), f"{r['fused_ms']:.3f}" if "fused_ms" in r else "-")
        ratio = f"{r['unfused_ms'] / r['fused_ms']:.2f}x" if "fused_ms" in r else "-"
        yes = "yes" if r["gqa"] else "no"
        print(
            f"| {r['family']} | {yes} | {r['unfused_nodes']} | {fused[0]} | "
            f"{r['unfused_ms']:.3f} | {fused[1]} | {ratio} |"
        )


if __name__ == "__main__":
    main()
