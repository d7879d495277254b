"""Export, check and run a 1B-class Llama built from its config with random weights (no download).

    python scripts/export_scale.py [--work /tmp/qspec-scale] [--layers 16] [--hidden 2048] ...

Steps, each in its own process so its time and peak RSS are its own (``os.wait4``):

1. ``build``: a ``LlamaForCausalLM`` from the config (random weights, tied embeddings) saved as a local
   folder with a word-level tokenizer over the whole vocabulary (skipped when the folder exists);
2. ``compile``: a cold ``qspec compile FOLDER -k 0,4`` (empty export cache): the export's phases
   come from its ``export.json``;
3. ``reference``: PyTorch's logits of a short prompt; ``onnx``: the exported graph's logits of the
   same prompt on ONNX Runtime (the vendor graph, fp32); their largest difference is the parity;
4. ``generate``: ``qspec generate PACKAGE`` on that prompt, ``pld`` and ``none``, outputs compared.

The report (also ``WORK/report.json``) gives each step's wall seconds and peak RSS.
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

PROMPT_IDS = [5, 17, 230, 4096, 77, 5, 17, 230, 4096, 77, 9, 11]
CTX_LEN = 256


def build(folder: Path, args) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).eval()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, args.vocab)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    os.replace(tmp, folder)


def prompt_ids(vocab: int) -> list[int]:
    return [i % vocab for i in PROMPT_IDS]


def reference(folder: Path, out: Path, ids: list[int]) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].numpy()
    np.save(out, logits)


def onnx_logits(package: Path, out: Path, ids: list[int]) -> None:
    """The vendor graph (model.onnx) on ONNX Runtime: one prefill call of the prompt, KV buffers of CTX_LEN."""
    import numpy as np
    import onnxruntime as ort

    from qspec import contract
    from qspec.package import ONNX_FILE, read_manifest

    info = read_manifest(package).model
    session = ort.InferenceSession(str(package / ONNX_FILE), providers=["CPUExecutionProvider"])
    shape = (1, info.num_kv_heads, CTX_LEN, info.head_dim)
    feeds = {name: np.zeros(shape, np.float32) for name in contract.kv_names(info.num_layers)}
    feeds[contract.INPUT_IDS] = np.array([ids], np.int64)
    feeds[contract.POSITION_IDS] = np.arange(len(ids), dtype=np.int64)[None]
    if info.speculative:
        feeds[contract.NUM_LOGITS_TO_KEEP] = np.zeros((1, 1), np.int64)
    np.save(out, session.run([contract.LOGITS], feeds)[0][0, -1])


def run_step(name: str, command: list[str], env: dict[str, str], log: Path, out: Path | None = None) -> dict:
    """Run ``command`` (stderr to ``log``, stdout to ``out`` or ``log``); its wall seconds, peak RSS (GB)."""
    print(f"== {name}: {' '.join(command)}", flush=True)
    begin = time.perf_counter()
    with open(log, "w") as sink, open(out or os.devnull, "w") as stdout:
        child = subprocess.Popen(command, env=env, stdout=stdout if out else sink, stderr=sink)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - begin
    code = os.waitstatus_to_exitcode(status)
    result = {"seconds": round(seconds, 1), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2), "exit": code}
    print(f"   {result}", flush=True)
    if code != 0:
        sys.exit(f"{name} failed (exit {code}); see {log}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qspec-scale"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--step", choices=["build", "reference", "onnx"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = args.work.absolute()
    folder, package, cache = work / "llama-1b", work / "package", work / "cache"
    if args.step == "build":
        return build(folder, args)
    if args.step == "reference":
        return reference(folder, work / "reference.npy", prompt_ids(args.vocab))
    if args.step == "onnx":
        return onnx_logits(package, work / "onnx.npy", prompt_ids(args.vocab))

    import numpy as np

    work.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"QSPEC_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    me = [sys.executable, __file__, "--work", str(work)]
    shape = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ("layers", "hidden", "intermediate", "heads")]
    shape += [f"--kv-heads={args.kv_heads}", f"--vocab={args.vocab}"]
    report: dict = {"model": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads")}}
    report["model"]["vocab"] = args.vocab
    if not (folder / "config.json").is_file():
        report["build"] = run_step("build", [*me, *shape, "--step", "build"], env, work / "build.log")
    report["weights_gb"] = round(sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e9, 2)
    shutil.rmtree(cache, ignore_errors=True)  # a cold export
    qspec = [str(Path(sys.executable).with_name("qspec"))]
    report["compile"] = run_step(
        "compile (cold export)",
        [*qspec, "compile", str(folder), "-k", "0,4", "--ctx-len", str(CTX_LEN), "--output", str(package), "--force"],
        env,
        work / "compile.log",
    )
    [export_json] = cache.glob("exports/*/export.json")
    export = json.loads(export_json.read_text())
    report["export"] = {"seconds": export.get("export_seconds"), "phases": export.get("phase_seconds")}
    data = sum(p.stat().st_size for p in package.glob("*.data"))
    report["package_data_gb"] = round(data / 1e9, 2)
    report["reference"] = run_step(
        "reference (PyTorch)", [*me, *shape, "--step", "reference"], env, work / "reference.log"
    )
    report["onnx"] = run_step("onnx (ONNX Runtime)", [*me, *shape, "--step", "onnx"], env, work / "onnx.log")
    want, got = np.load(work / "reference.npy"), np.load(work / "onnx.npy")
    report["parity"] = {
        "max_abs_diff": float(np.abs(want - got).max()),
        "logit_scale": float(np.abs(want).max()),
        "argmax_equal": bool(want.argmax() == got.argmax()),
    }
    prompt = " ".join(f"w{i}" for i in prompt_ids(args.vocab))
    tokens = {}
    for method in ("pld", "none"):
        out = work / f"generate-{method}.json"
        generate = [*qspec, "generate", str(package), "--prompt", prompt, "--max-new-tokens", "24", "--method", method]
        report[f"generate_{method}"] = run_step(
            f"generate {method}", [*generate, "--json"], env, work / f"generate-{method}.log", out
        )
        [request] = json.loads(out.read_text())["requests"]
        tokens[method] = request["token_ids"]
    report["generated_tokens"] = len(tokens["none"])
    report["generate_pld_equals_none"] = tokens["pld"] == tokens["none"]
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
