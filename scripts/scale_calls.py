"""What a verify call costs at 8B scale on this CPU, per K, and the speedup each drafter would reach there.

    python scripts/scale_calls.py [--layers 2,4,8] [--ks 0,1,2,4,8] [--work /tmp/qspec-scale-calls]
                                  [--acceptance bench-out/report.json] [--report docs/bench/scale/8b-calls.json]

A Llama-3.1-8B shaped checkpoint (random bf16 weights, ``scripts/export_scale.py``'s builder) with the largest
``--layers`` count is written once; ``qspec compile --num-layers N -k KS --weight-format int4`` compiles each
count (one package on disk at a time). Each package's decode call is timed per K, interleaved (every K once
per round, ``qspec.runtime.dispatch.measure_live_costs``: every row live). Layers are identical, so a call
costs ``a + b * layers`` (``a``: embedding, final norm, LM head; ``b``: one layer): fitted per K over the
counts, it gives the 32-layer call. Tree calls of ``n`` tokens cost what a chain call of ``n`` tokens costs
(the same rows through the same MatMuls; only attention's mask differs), so the K column prices them too.

``--compile-only`` compiles (heavy: run it while nothing is timed), a second run times (on a quiet machine).
The projection: a drafter whose draft ``i`` survives with chance ``c_1 ... c_i`` (chain acceptance, measured
on SmolLM2 by ``qspec bench``: ``--acceptance`` reads a bench report's per-position acceptance) yields
``1 + c_1 + c_1 c_2 + ...`` tokens per call of K; at 8B, with drafting costs (``--head-ms`` per EAGLE head call,
else one layer plus a 32k-vocabulary LM head share of ``a``), the speedup over K=0 is
``tokens(K) * cost(0) / (cost(K) + drafting)``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_scale import PRESETS, build  # noqa: E402

HEAD_VOCAB = 32000  # an EAGLE-3 head's draft vocabulary for Llama-3.1-8B (the published heads')


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x``: (a, b, largest relative residual)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    worst = max(abs(a + b * x - y) / y for x, y in zip(xs, ys))
    return a, b, worst


def time_package(package: Path, ks: list[int], repeats: int) -> dict[int, float]:
    """Median ms of each K's decode call, every row live, interleaved over ``repeats`` rounds."""
    from qspec.runtime.dispatch import measure_live_costs
    from qspec.runtime.load import load_model

    model = load_model(package)
    measure_live_costs(model, ks, 2)  # warm-up: first calls allocate
    costs = measure_live_costs(model, ks, repeats)
    return {k: round(costs[k], 2) for k in ks}


def chain_acceptance(report: Path | None, given: list[str]) -> dict[str, list[float]]:
    """Per drafter, its chain acceptance ``c_i``: from a bench report (each method's batch-1 fp32 run with the
    most Ks: ``acceptance_per_position``, up to its first empty position), then ``NAME=c1,c2,...`` overrides."""
    out: dict[str, list[float]] = {}
    if report is not None:
        runs = [c for c in json.loads(report.read_text())["configs"] if c["batch"] == 1]
        runs = [c for c in runs if c.get("weight_format", "fp32") == "fp32" and c["method"] != "none"]
        for run in sorted(runs, key=lambda c: len(c["ks"])):
            chain = []
            for c in run["overall"].get("acceptance_per_position") or []:
                if c is None:
                    break
                chain.append(float(c))
            if chain:
                out[run["method"]] = chain
    for item in given:
        name, _, values = item.partition("=")
        out[name] = [float(v) for v in values.split(",")]
    return out


def project(costs: dict[int, float], head_ms: float, acceptance: dict[str, list[float]]) -> dict[str, dict]:
    """Per drafter and K: tokens per call and the speedup over K=0 (chained drafting: K head calls)."""
    out: dict[str, dict] = {}
    for method, chain in acceptance.items():
        per_k = {}
        for k, ms in costs.items():
            if k == 0 or k > len(chain):
                continue
            survive, tokens = 1.0, 1.0
            for c in chain[:k]:
                survive *= c
                tokens += survive
            drafting = k * head_ms if "eagle" in method else 0.0
            per_k[k] = {"tokens_per_call": round(tokens, 3), "speedup": round(tokens * costs[0] / (ms + drafting), 3)}
        out[method] = per_k
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,4,8")
    parser.add_argument("--ks", default="0,1,2,4,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--work", type=Path, default=Path("/tmp/qspec-scale-calls"))
    parser.add_argument("--acceptance", type=Path, help="a qspec bench report.json (per-position acceptance)")
    parser.add_argument("--chain", action="append", default=[], help="NAME=c1,c2,...: a drafter's chain acceptance")
    parser.add_argument("--head-ms", type=float, help="ms of one EAGLE head call at 8B (default: estimated)")
    parser.add_argument("--report", type=Path, default=Path("docs/bench/scale/8b-calls.json"))
    parser.add_argument("--compile-only", action="store_true", help="compile the packages, time them in a later run")
    parser.add_argument("--clean", action="store_true", help="remove the checkpoint and packages after timing")
    args = parser.parse_args()
    layers = sorted(int(n) for n in args.layers.split(","))
    ks = sorted(int(k) for k in args.ks.split(","))
    shape = PRESETS["8b"] | {"layers": layers[-1]}
    work = args.work.absolute()
    folder = work / f"llama-8b-shape-{layers[-1]}l"
    work.mkdir(parents=True, exist_ok=True)
    if not (folder / "config.json").is_file():
        build(folder, shape)
    env = os.environ | {"QSPEC_CACHE_DIR": str(work / "cache"), "HF_HUB_OFFLINE": "1"}
    qspec = str(Path(sys.executable).with_name("qspec"))
    report: dict = {"shape": PRESETS["8b"], "layers_timed": layers, "ks": ks, "repeats": args.repeats, "calls_ms": {}}
    packages = {n: work / f"package-{n}l" for n in layers}
    for n, package in packages.items():
        if (package / "manifest.json").is_file():
            continue
        begin = time.perf_counter()
        subprocess.run(
            [qspec, "compile", str(folder), "--num-layers", str(n), "-k", ",".join(map(str, ks)),
             "--ctx-len", "1024", "--weight-format", "int4", "--output", str(package), "--force"],
            env=env, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        shutil.rmtree(work / "cache", ignore_errors=True)  # the fp32 export: only the int4 package stays
        print(f"{n} layers compiled in {time.perf_counter() - begin:.0f} s", flush=True)
    if args.compile_only:
        return
    for n, package in packages.items():
        report["calls_ms"][n] = time_package(package, ks, args.repeats)
        print(f"{n} layers: {report['calls_ms'][n]}", flush=True)
    full = PRESETS["8b"]["layers"]
    fitted = {}
    for k in ks:
        a, b, worst = fit_line(layers, [report["calls_ms"][n][k] for n in layers])
        fitted[k] = {"fixed_ms": round(a, 2), "per_layer_ms": round(b, 3), "worst_residual": round(worst, 4),
                     "projected_ms": round(a + b * full, 1)}  # fmt: skip
    report["fit"] = fitted
    projected = {k: fitted[k]["projected_ms"] for k in ks}
    vocab_share = HEAD_VOCAB / PRESETS["8b"]["vocab"]
    head_ms = args.head_ms or round(fitted[0]["per_layer_ms"] + fitted[0]["fixed_ms"] * vocab_share, 2)
    report["head_ms"] = {"value": head_ms, "how": "given" if args.head_ms else "one layer + 32k/128k of fixed"}
    chains = chain_acceptance(args.acceptance, args.chain)
    if chains:
        report["chains"] = chains
        report["projection"] = project(projected, head_ms, chains)
    if args.clean:
        shutil.rmtree(work)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
