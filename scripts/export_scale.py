"""Compile and run a Llama-3.2-1B / Llama-3.1-8B shaped model with random bf16 weights (no download).

    python scripts/export_scale.py --preset 1b|8b [--work /tmp/qspec-scale] [--report docs/bench/scale]

Steps, each in its own process so its time, peak RSS and bytes written are its own (``os.wait4``:
``ru_maxrss`` and ``ru_oublock`` cover the step and the processes it waited for, the export's included):

1. ``build``: the checkpoint, written shard by shard in bf16 safetensors with an index (random
   weights, one tensor in memory at a time) and a word-level tokenizer over the whole vocabulary
   (skipped when the folder exists);
2. ``compile``: a cold ``qspec compile FOLDER -k 0,4 --ctx-len 1024 --weight-format int4`` (empty
   export cache): the export's phases and peak RSS come from its ``export.json``;
3. ``cut``: the export of the first 2 layers (``num_layers=2``) and ``reference``: PyTorch's logits of the
   same cut on a prompt; their largest difference is the parity;
4. ``generate``: ``qspec generate PACKAGE`` on that prompt, ``none`` and ``pld``, tokens compared;
5. ``batching`` (``--batching``): the same compile with ``--full-batch-size 2`` and two prompts at once,
   ``none`` and ``pld``.

The report goes to ``WORK/report.json`` and ``REPORT/<preset>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PRESETS: dict[str, dict] = {
    # Llama-3.2-1B: tied embeddings, RoPE llama3 factor 32.
    "1b": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256, tie=True, factor=32.0),
    # Llama-3.1-8B: untied LM head, RoPE llama3 factor 8.
    "8b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, tie=False, factor=8.0),
}
PROMPT_IDS = [5, 17, 230, 4096, 77, 5, 17, 230, 4096, 77, 9, 11]
SHARD_BYTES = 2 << 30
CTX_LEN = 1024
CUT_LAYERS = 2
PARITY_CTX = 64


def checkpoint_plan(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint of ``shape``, in file order: (name, shape)."""
    h, i, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    d = h // shape["heads"]
    plan = [("model.embed_tokens.weight", (v, h))]
    for n in range(shape["layers"]):
        p = f"model.layers.{n}."
        plan += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (shape["heads"] * d, h)),
            (p + "self_attn.k_proj.weight", (shape["kv_heads"] * d, h)),
            (p + "self_attn.v_proj.weight", (shape["kv_heads"] * d, h)),
            (p + "self_attn.o_proj.weight", (h, shape["heads"] * d)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    plan.append(("model.norm.weight", (h,)))
    if not shape["tie"]:
        plan.append(("lm_head.weight", (v, h)))
    return plan


def shards(plan, limit: int = SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``plan`` cut into consecutive shards of at most ``limit`` bf16 bytes (a larger tensor alone)."""
    out, size = [[]], 0
    for name, dims in plan:
        nbytes = 2 * _numel(dims)
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, dims))
        size += nbytes
    return out


def _numel(dims) -> int:
    total = 1
    for d in dims:
        total *= d
    return total


def build(folder: Path, shape: dict) -> None:
    """Write the checkpoint shard by shard (bf16, random), its index, config and tokenizer."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    parts = shards(checkpoint_plan(shape))
    weight_map, total = {}, 0
    for k, part in enumerate(parts):
        file = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
        tensors = {}
        for name, dims in part:
            if len(dims) == 1:
                tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                tensors[name] = torch.empty(dims, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)
            weight_map[name] = file
            total += tensors[name].nbytes
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        print(f"   shard {k + 1}/{len(parts)}: {sum(t.nbytes for t in tensors.values()) / 2**30:.2f} GiB", flush=True)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["hidden"] // shape["heads"],
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": shape["factor"],
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=shape["tie"],
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    )
    config.save_pretrained(tmp)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, shape["vocab"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(tmp)
    os.replace(tmp, folder)


def prompt_ids(vocab: int) -> list[int]:
    return [i % vocab for i in PROMPT_IDS]


def cut(folder: Path, out: Path, ids: list[int]) -> None:
    """The streamed export of the first CUT_LAYERS layers; its logits of ``ids`` on ONNX Runtime."""
    import numpy as np
    import onnxruntime as ort

    from qspec import contract
    from qspec.export import ExportOptions, export_model
    from qspec.package import ONNX_FILE

    export, meta = export_model(folder, ExportOptions(num_layers=CUT_LAYERS))
    assert meta.streamed, "the cut was not streamed"
    info = meta.model
    session = ort.InferenceSession(str(export / ONNX_FILE), providers=["CPUExecutionProvider"])
    shape = (1, info.num_kv_heads, PARITY_CTX, info.head_dim)
    feeds = {name: np.zeros(shape, np.float32) for name in info.kv_names()}
    feeds[contract.INPUT_IDS] = np.array([ids], np.int64)
    feeds[contract.POSITION_IDS] = np.arange(len(ids), dtype=np.int64)[None]
    feeds[contract.NUM_LOGITS_TO_KEEP] = np.zeros((len(ids), 1), np.int64)
    np.save(out, session.run([contract.LOGITS], feeds)[0][0])


def reference(folder: Path, out: Path, ids: list[int]) -> None:
    """PyTorch's logits of ``ids`` for the first CUT_LAYERS layers (only those weights are loaded)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, num_hidden_layers=CUT_LAYERS).eval()
    with torch.no_grad():
        np.save(out, model(torch.tensor([ids])).logits[0].numpy())


def run_step(name: str, command: list[str], env: dict[str, str], log: Path, out: Path | None = None) -> dict:
    """Run ``command`` (stderr to ``log``, stdout to ``out`` or ``log``); wall seconds, peak RSS, bytes written."""
    print(f"== {name}: {' '.join(command)}", flush=True)
    begin = time.perf_counter()
    with open(log, "w") as sink, open(out or os.devnull, "w") as stdout:
        child = subprocess.Popen(command, env=env, stdout=stdout if out else sink, stderr=sink)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - begin
    code = os.waitstatus_to_exitcode(status)
    result = {
        "seconds": round(seconds, 1),
        "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
        "written_gb": round(usage.ru_oublock * 512 / 1e9, 2),
        "exit": code,
    }
    print(f"   {result}", flush=True)
    if code != 0:
        sys.exit(f"{name} failed (exit {code}); see {log}")
    return result


def generate(qspec: list[str], package: Path, prompts: list[str], work: Path, env, tag: str) -> dict:
    """``qspec generate`` with none and pld: step numbers, tokens/s, and whether the tokens are equal."""
    file = work / f"prompts-{tag}.jsonl"
    file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result, tokens = {}, {}
    for method in ("none", "pld"):
        out = work / f"generate-{tag}-{method}.json"
        command = [*qspec, "generate", str(package), "--prompts-file", str(file), "--max-new-tokens", "24"]
        command += ["--method", method, "--json"]
        step = run_step(f"generate {tag} {method}", command, env, out.with_suffix(".log"), out)
        document = json.loads(out.read_text())
        tokens[method] = [r["token_ids"] for r in document["requests"]]
        step["tokens_per_s"] = round(document["metrics"]["output_tokens_per_s"], 2)
        result[method] = step
    result["pld_equals_none"] = tokens["pld"] == tokens["none"]
    result["generated_tokens"] = [len(t) for t in tokens["none"]]
    return result


def compile_step(qspec, folder: Path, package: Path, env, work: Path, extra: list[str], tag: str) -> dict:
    """A cold compile (empty export cache), its numbers and its export's ``export.json`` numbers."""
    cache = Path(env["QSPEC_CACHE_DIR"])
    shutil.rmtree(cache, ignore_errors=True)
    command = [*qspec, "compile", str(folder), "-k", "0,4", "--ctx-len", str(CTX_LEN), "--weight-format", "int4"]
    result = run_step(
        f"compile {tag}", [*command, *extra, "--output", str(package), "--force"], env, work / f"compile-{tag}.log"
    )
    exports = [json.loads(p.read_text()) for p in cache.glob("exports/*/export.json")]
    result["export"] = [
        {
            "seconds": e["export_seconds"],
            "phases": e["phase_seconds"],
            "streamed": e.get("streamed"),
            "peak_rss_gb": round((e.get("peak_rss_bytes") or 0) / 2**30, 2),
            "data_gb": round(e["data_bytes"] / 1e9, 2),
        }
        for e in exports
    ]
    result["package_gb"] = round(_folder_bytes(package) / 1e9, 2)
    result["cache_gb"] = round(_folder_bytes(cache) / 1e9, 2)
    return result


def _folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder`` (a hard link counted once)."""
    seen, total = set(), 0
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            stat = path.stat()
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--work", type=Path, default=Path("/tmp/qspec-scale"))
    parser.add_argument("--report", type=Path, default=Path("docs/bench/scale"))
    parser.add_argument("--batching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--step", choices=["build", "reference", "cut"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    work = (args.work / args.preset).absolute()
    folder = work / f"llama-{args.preset}"
    ids = prompt_ids(shape["vocab"])
    if args.step == "build":
        return build(folder, shape)
    if args.step == "reference":
        return reference(folder, work / "reference.npy", ids)
    if args.step == "cut":
        return cut(folder, work / "cut.npy", ids)

    import numpy as np

    work.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"QSPEC_CACHE_DIR": str(work / "cache"), "HF_HUB_OFFLINE": "1"}
    me = [sys.executable, __file__, "--preset", args.preset, "--work", str(args.work.absolute())]
    qspec = [str(Path(sys.executable).with_name("qspec"))]
    report: dict = {"preset": args.preset, "shape": shape, "ctx_len": CTX_LEN}
    if not (folder / "config.json").is_file():
        report["build"] = run_step("build", [*me, "--step", "build"], env, work / "build.log")
    report["checkpoint_gb"] = round(_folder_bytes(folder) / 1e9, 2)
    report["fp32_gb"] = round(sum(4 * _numel(d) for _, d in checkpoint_plan(shape)) / 1e9, 2)
    package = work / "package"
    report["compile"] = compile_step(qspec, folder, package, env, work, [], "int4")
    prompt = " ".join(f"w{i}" for i in ids)
    report["generate"] = generate(qspec, package, [prompt], work, env, "one")
    shutil.rmtree(package)  # with the cache's export (its weights): an 8B package is ~37 GB of disk
    shutil.rmtree(work / "cache", ignore_errors=True)  # the cut's export starts cold
    report["cut"] = run_step("cut (streamed export)", [*me, "--step", "cut"], env, work / "cut.log")
    report["reference"] = run_step("reference (PyTorch)", [*me, "--step", "reference"], env, work / "reference.log")
    want, got = np.load(work / "reference.npy"), np.load(work / "cut.npy")
    report["parity"] = {
        "layers": CUT_LAYERS,
        "max_abs_diff": float(np.abs(want - got).max()),
        "logit_scale": float(np.abs(want).max()),
        "argmax_equal": bool((want.argmax(-1) == got.argmax(-1)).all()),
    }
    if args.batching:
        batched = work / "package-fbs2"
        report["compile_fbs2"] = compile_step(qspec, folder, batched, env, work, ["--full-batch-size", "2"], "fbs2")
        prompts = [prompt, " ".join(f"w{i}" for i in reversed(ids))]
        report["generate_fbs2"] = generate(qspec, batched, prompts, work, env, "fbs2")
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    args.report.mkdir(parents=True, exist_ok=True)
    (args.report / f"{args.preset}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
