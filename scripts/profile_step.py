"""Where a one-token decode step goes: qspec's int4 runtime graph against ONNX Runtime GenAI's, side by side.

Three measurements, each at positions 100 / 400 / 800 (``--positions``), both runtimes on the same
intra-op threads (``--threads``), in one process, interleaved so that a shared machine's drift hits both:

1. **call**: the one-token decode call alone (ORT ``run_with_iobinding``, KV bound in place), median ms and
   the median of paired ratios (one call of each graph in turn, shuffled).
   qspec's call is the engine's own (``CompiledModel``, its K=0 binding); GenAI's graph runs in a plain
   ORT session as GenAI runs it (past and present bound to one buffer, ``attention_mask`` of P + 1 ones).
   ``--no-pad-graph`` adds qspec's graph rebuilt without the exactness pad (a lone query token: NOT exact,
   for measurement only) to price the pad.
2. **profile** (``--profile``): ORT's profiler on each graph, node by node, summed per op type and per
   layer part (attention = GroupQueryAttention: RoPE, KV write and read, softmax; its pad = Pad/Slice
   around it; projections; MLP; norms; embedding; LM head; the prologue's small shape ops), per call.
3. **host** (``--host``): a real decode loop, ms per step minus the ORT run inside it: qspec's ``Engine``
   (``none``, greedy) with ``model.run`` timed, and GenAI's ``Generator`` (``generate_next_token``) with
   its session profiled (its ``model_run`` events); and the time to the first token of both.

``--widths`` measures only this, and exits: a call of every compiled K of ``PACKAGE`` (``S = K + 1`` tokens)
against GenAI's graph at the same widths, neither session spinning: what a verify call costs against a
one-token call in each runtime.

``--compare OTHER_PACKAGE`` times a second package beside qspec's (paired: a graph recipe's before/after);
``--session-config KEY=VALUE`` the same graph with extra session entries.

Usage::

    python scripts/profile_step.py PACKAGE GENAI_DIR --positions 100,400,800 --threads 2 --profile --host

``PACKAGE``: an int4 package (``qspec compile ... --weight-format int4``); ``GENAI_DIR``: GenAI's model
builder's int4 folder (``<qspec cache>/peers/<digest>/ort-genai-<version>-int4``, made by ``qspec bench``).
Prints markdown tables (docs/perf.md holds a run of them) and, with ``--json``, writes the numbers.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import copy
import gc
import json
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np
import onnx
import onnxruntime as ort

from qspec.runtime.model import CompiledModel

PARTS = (
    "attention (GQA)",
    "attention pad",
    "qkv proj",
    "o proj",
    "MLP matmuls",
    "MLP act",
    "norms",
    "embedding",
    "lm head",
    "prologue",
)


# ------------------------------------------------------------------ the two calls


class QspecCall:
    """qspec's call as the engine makes it: the binding of K (default 0, the one-token call) of a loaded
    package, one live row of ``K + 1`` tokens. ``model``: a package already loaded (its Ks share it)."""

    def __init__(self, package: Path, threads: int, *, k: int = 0, model: CompiledModel | None = None):
        self.model = model or CompiledModel(package, num_threads=threads)
        self.k = k
        self.bound = self.model.decode[k]
        self.session = self.bound.session

    def at(self, position: int) -> None:
        self.bound.reset()
        self.bound.input_ids[0, : self.k + 1] = 1
        self.bound.position_ids[0, : self.k + 1] = np.arange(position, position + self.k + 1)

    def run(self) -> None:
        self.model.run(self.bound)


def genai_options(
    threads: int, *, spinning: bool = True, profile: str | None = None, optimized: Path | None = None
) -> ort.SessionOptions:
    """The session options GenAI's overlay sets in the bench (intra-op threads, one inter-op thread)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = profile
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", optimized.name + ".data"
        )
    return options


class GenaiCall:
    """GenAI's graph in a plain ORT session, bound as GenAI binds it (past and present share one buffer), a
    call of ``width`` tokens (:meth:`with_width`: another width on the same session and KV buffers)."""

    def __init__(self, folder: Path, threads: int, kv_len: int, options: ort.SessionOptions | None = None):
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        decoder = config["decoder"]
        self.session = ort.InferenceSession(
            str(folder / decoder["filename"]), options or genai_options(threads), providers=["CPUExecutionProvider"]
        )
        self.layers, self.vocab = decoder["num_hidden_layers"], config["vocab_size"]
        self.names = decoder["inputs"], decoder["outputs"]
        shape = (1, decoder["num_key_value_heads"], kv_len, decoder["head_size"])
        self.kv = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for _ in range(2 * self.layers)]
        self._bind(1)

    def with_width(self, width: int) -> GenaiCall:
        other = copy.copy(self)
        other._bind(width)
        return other

    def _bind(self, width: int) -> None:
        inputs, outputs = self.names
        self.width = width
        self.ids = np.ones((1, width), np.int64)
        self.logits = np.zeros((1, width, self.vocab), np.float32)
        self.binding = self.session.io_binding()
        self.binding.bind_cpu_input(inputs["input_ids"], self.ids)
        self.binding.bind_ortvalue_output(outputs["logits"], ort.OrtValue.ortvalue_from_numpy(self.logits))
        for i in range(self.layers):
            for j, kind in enumerate(("key", "value")):
                value = self.kv[2 * i + j]
                self.binding.bind_ortvalue_input(inputs[f"past_{kind}_names"] % i, value)
                self.binding.bind_ortvalue_output(outputs[f"present_{kind}_names"] % i, value)
        self.mask_name = inputs["attention_mask"]
        self.masks: dict[int, ort.OrtValue] = {}

    def at(self, position: int) -> None:
        if position not in self.masks:
            mask = np.ones((1, position + self.width), np.int64)
            self.masks[position] = ort.OrtValue.ortvalue_from_numpy(mask)
        self.binding.bind_ortvalue_input(self.mask_name, self.masks[position])

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


def time_interleaved(calls: dict[str, object], position: int, iterations: int) -> dict[str, list[float]]:
    """ms of ``iterations`` calls of each, one call of each in turn, in a shuffled order each turn (a shared
    machine's load moves within seconds: alternating single calls lets it hit every graph alike and pairs
    the samples; the shuffle keeps a graph from always following the same one)."""
    for call in calls.values():
        call.at(position)
        for _ in range(5):
            call.run()
    took: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    shuffle = random.Random(position).shuffle
    for _ in range(iterations):
        shuffle(order)
        for name, call in order:
            begin = time.perf_counter()
            call.run()
            took[name].append((time.perf_counter() - begin) * 1000)
    return took


def paired(a: list[float], b: list[float], how=lambda x, y: x / y) -> float:
    """The median of ``how(a_i, b_i)`` over the paired samples."""
    return median(how(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ a graph without the pad (measurement only)


def no_pad_package(package: Path, work: Path) -> Path:
    """``package`` with its runtime graph rebuilt from its export with one query token per one-token call (the
    graph a package without drafts gets, ``lone_query``).

    Not exact for a package with drafts (a lone query rounds differently from a verify call's row): only to
    price the pad."""
    from qspec.backends import ort_optimize
    from qspec.package import check_package

    manifest = check_package(package)
    copy = work / "no-pad"
    copy.mkdir()
    for item in package.iterdir():
        if not item.name.startswith("model.ort.onnx"):
            (copy / item.name).symlink_to(item.resolve())
    graph = manifest.runtime_graph
    ort_optimize.optimize_graph(
        package / "model.onnx",
        copy / graph.file,
        graph.weight_format,
        attention=manifest.model.attention,
        rope_positions=graph.rope_positions,
        lone_query=True,
    )
    return copy


# ------------------------------------------------------------------ the profiler


def part_of(node: onnx.NodeProto) -> str:
    """The layer part a node of either graph belongs to (see PARTS)."""
    op = node.op_type
    weights = " ".join(node.input[1:2])
    if op == "GroupQueryAttention":
        return "attention (GQA)"
    if op in ("Pad", "Slice") and ("to_query" in node.name or "own_tokens" in node.name):
        return "attention pad"
    if op in ("MatMulNBits", "MatMul"):
        if "lm_head" in weights or "embed" in weights or any(a.name == "N" and a.i > 10000 for a in node.attribute):
            return "lm head"
        if "o_proj" in weights:
            return "o proj"
        if re.search(r"(qkv|q|k|v)_proj", weights):
            return "qkv proj"
        return "MLP matmuls"
    if op in ("QuickGelu", "Sigmoid", "Mul", "FastGelu"):
        return "MLP act"
    if "LayerNormalization" in op or (op == "Add" and node.input and "add_" in node.output[0]):
        return "norms"
    if op in ("Gather", "GatherBlockQuantized") and ("embed" in node.input[0] or "lm_head" in node.input[0]):
        return "embedding"
    return "prologue"


def profile_calls(profiled: dict, positions: list[int], calls: int) -> dict:
    """ORT's profiler on every ``(session, call, nodes)`` of ``profiled``, one call of each in turn: per
    position and graph, the median over calls of µs per call of each part, op type, model_run and the sum
    of its kernels."""
    order: dict[str, list[int]] = {name: [] for name in profiled}  # the position of each run, in order
    for position in positions:
        for name, (_, call, _) in profiled.items():
            call.at(position)
            for _ in range(3):
                call.run()
            order[name] += [-1] * 3
        for _ in range(calls):
            for name, (_, call, _) in profiled.items():
                call.at(position)
                call.run()
                order[name].append(position)
    result: dict = {}
    for name, (session, _, nodes) in profiled.items():
        events = json.loads(Path(session.end_profiling()).read_text())
        runs = sorted(
            (e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"), key=lambda e: e["ts"]
        )
        assert len(runs) == len(order[name]), f"{name}: {len(runs)} model_run events for {len(order[name])} calls"
        starts = [r["ts"] for r in runs]
        per_run = [collections.Counter() for _ in runs]
        per_op = [collections.Counter() for _ in runs]
        for e in events:
            if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
                continue
            i = bisect.bisect_right(starts, e["ts"]) - 1
            node = nodes.get(e["name"].removesuffix("_kernel_time"))
            per_run[i][part_of(node) if node is not None else "prologue"] += e["dur"]
            per_op[i][e.get("args", {}).get("op_name") or "?"] += e["dur"]
        result[name] = {}
        for position in positions:
            chosen = [i for i, p in enumerate(order[name]) if p == position]
            ops = sorted({op for i in chosen for op in per_op[i]})
            result[name][position] = {
                "model_run_us": median(runs[i]["dur"] for i in chosen),
                "kernels_us": median(sum(per_run[i].values()) for i in chosen),
                "by_part": {part: median(per_run[i][part] for i in chosen) for part in PARTS},
                "by_op": {op: median(per_op[i][op] for i in chosen) for op in ops},
                "nodes": len(nodes),
            }
    return result


def profiled_session(make, work: Path, tag: str):
    """``(session, call, {node name: node})``: ``make(prefix, optimized path)`` with the graph ORT runs."""
    optimized = work / f"{tag}.optimized.onnx"
    session, call = make(str(work / tag), optimized)
    graph = onnx.load(str(optimized), load_external_data=False).graph
    return session, call, {node.name: node for node in graph.node}


# ------------------------------------------------------------------ host time per step


def prompt_of(tokenizer_dir: Path, length: int) -> list[int]:
    """Token ids of about ``length`` tokens of plain English (repeated text: a decode cost is position-bound)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text = (
        "The history of the bicycle spans more than two centuries, from wooden running machines to carbon frames. "
        "Each change answered a need of its riders: speed, comfort, safety or the price of a machine. "
    )
    ids: list[int] = []
    while len(ids) < length:
        ids += tok.encode(text).ids
    return ids[:length]


def qspec_host(package: Path, threads: int, prompt: list[int], new_tokens: int, engine=None) -> dict:
    """ms per decode step of qspec's engine (``none``, greedy) and of the ORT runs inside it."""
    from qspec.runtime import Engine, SamplingParams

    engine = engine or Engine(package, method="none", num_threads=threads)
    runs: list[float] = []
    model = engine.model
    inner = type(model).run

    def timed(bound):
        begin = time.perf_counter()
        out = inner(model, bound)
        runs.append(time.perf_counter() - begin)
        return out

    model.run = timed
    try:
        steps: list[float] = []
        engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        begin = time.perf_counter()
        engine.step()  # the prefill (the first token) and the first decode step
        first = time.perf_counter() - begin
        runs.clear()
        while engine.has_unfinished():
            begin = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - begin)
    finally:
        del model.run
    n = min(len(steps), len(runs))
    return {
        "step_ms": median(steps) * 1000,
        "ttft_ms": (first - median(steps)) * 1000,
        "run_ms": median(runs[:n]) * 1000,
        "host_ms": median(s - r for s, r in zip(steps[:n], runs[:n])) * 1000,
    }, engine


def genai_host(folder: Path, threads: int, prompt: list[int], new_tokens: int, work: Path) -> dict:
    """ms per ``generate_next_token`` + ``get_next_tokens`` of GenAI's greedy loop (the bench's), and of the
    ORT run inside it (GenAI's session profiled: its ``model_run`` events; the profiler costs both alike)."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    prefix = str(work / f"genai-host-{len(prompt)}")
    session = {"intra_op_num_threads": threads, "inter_op_num_threads": 1, "enable_profiling": prefix}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": session}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens + 1, do_sample=False, min_length=0)
    generator = og.Generator(model, params)
    begin = time.perf_counter()
    generator.append_tokens(prompt)
    generator.generate_next_token()  # the prefill (the first token)
    generator.get_next_tokens()
    ttft = time.perf_counter() - begin
    steps: list[float] = []
    for _ in range(new_tokens):
        begin = time.perf_counter()
        generator.generate_next_token()
        generator.get_next_tokens()
        steps.append(time.perf_counter() - begin)
    del generator, params, model  # writes the profile
    gc.collect()
    files = sorted(work.glob(f"genai-host-{len(prompt)}*.json"))
    runs = []
    if files:
        events = json.loads(files[-1].read_text())
        runs = [e["dur"] / 1000 for e in sorted(events, key=lambda e: e["ts"]) if e.get("name") == "model_run"]
    # The decode steps' runs are the last ones (the prefill ran before).
    runs = runs[-len(steps) :]
    result = {"step_ms": median(steps) * 1000, "ttft_ms": ttft * 1000}
    if len(runs) == len(steps):
        result |= {"run_ms": median(runs), "host_ms": median(s * 1000 - r for s, r in zip(steps, runs))}
    return result


# ------------------------------------------------------------------ main


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verify_cost(package: Path, genai_dir: Path, positions: list[int], threads: int, iterations: int) -> dict:
    """Median ms of a call of every compiled K of ``package`` (``S = K + 1`` tokens) and of GenAI's graph at the
    same widths, per position; neither session spinning (the idle one would steal the cores of the one that
    runs). Prints the table and returns ``{position: {"qspec S=..": ms, "GenAI S=..": ms}}``."""
    model = CompiledModel(package, num_threads=threads, spinning=False)
    model.warm_up()
    ks = sorted(model.decode)
    genai = GenaiCall(genai_dir, threads, model.kv_len, genai_options(threads, spinning=False))
    calls = {f"qspec S={k + 1}": QspecCall(package, threads, k=k, model=model) for k in ks}
    calls |= {f"GenAI S={k + 1}": genai.with_width(k + 1) for k in ks}
    out, rows = {}, []
    for position in positions:
        ms = {name: median(took) for name, took in time_interleaved(calls, position, iterations).items()}
        out[position] = ms
        cells = [f"{ms[name]:.2f} ({ms[name] / ms[name.split()[0] + ' S=1']:.2f})" for name in calls]
        rows.append([position, *cells, f"{ms['qspec S=1'] / ms['GenAI S=1']:.3f}"])
    print(f"## A call of S = K + 1 tokens (median of {iterations}; in brackets: x the same graph's S=1)\n")
    print(table(["position", *calls, "qspec / GenAI, S=1"], rows) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("genai", type=Path)
    parser.add_argument("--positions", default="100,400,800")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--no-pad-graph", action="store_true", help="also time a graph without the pad (inexact)")
    parser.add_argument("--compare", type=Path, help="a second package (another graph recipe) timed beside")
    parser.add_argument(
        "--session-config", action="append", default=[], help="KEY=VALUE: qspec's graph with this session entry too"
    )
    parser.add_argument("--profile", action="store_true", help="ORT's profiler on both graphs")
    parser.add_argument("--profile-calls", type=int, default=50)
    parser.add_argument("--host", action="store_true", help="host time per step of both decode loops")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--widths", action="store_true", help="only: every compiled K's call against GenAI's graph at that width"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    out: dict = {"positions": positions, "threads": args.threads}
    if args.widths:
        out["width_ms"] = verify_cost(args.package, args.genai, positions, args.threads, args.iterations)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n")
        return
    work = Path(tempfile.mkdtemp(prefix="profile-step-"))
    try:
        qspec = QspecCall(args.package, args.threads)
        genai = GenaiCall(args.genai, args.threads, qspec.model.kv_len)
        calls = {"qspec": qspec, "genai": genai}
        if args.no_pad_graph:
            calls["qspec no pad"] = QspecCall(no_pad_package(args.package, work), args.threads)
        if args.compare is not None:
            calls["qspec B"] = QspecCall(args.compare, args.threads)
        if args.session_config:
            calls["qspec cfg"] = configured(qspec, args.threads, dict(e.split("=", 1) for e in args.session_config))
        samples = {p: time_interleaved(calls, p, args.iterations) for p in positions}
        out["call_ms"] = {p: {name: median(t) for name, t in took.items()} for p, took in samples.items()}
        rows = []
        for p, took in samples.items():
            ms = out["call_ms"][p]
            row = [p, f"{ms['qspec']:.2f}", f"{ms['genai']:.2f}", f"{paired(took['qspec'], took['genai']):.3f}"]
            if "qspec no pad" in ms:
                pad = paired(took["qspec"], took["qspec no pad"], lambda x, y: x - y)
                nopad = paired(took["qspec no pad"], took["genai"])
                row += [f"{ms['qspec no pad']:.2f}", f"{nopad:.3f}", f"{pad:.2f}"]
            for variant in ("qspec B", "qspec cfg"):
                if variant in ms:
                    row += [f"{ms[variant]:.2f}", f"{paired(took[variant], took['qspec']):.3f}"]
            rows.append(row)
        header = ["position", "qspec ms", "GenAI ms", "qspec / GenAI (paired)"]
        if args.no_pad_graph:
            header += ["qspec no pad ms", "no pad / GenAI", "pad ms (paired)"]
        if args.compare is not None:
            header += ["B ms", "B / qspec (paired)"]
        if args.session_config:
            header += ["cfg ms", "cfg / qspec (paired)"]
        print(f"## One-token call (median of {args.iterations}, one call of each in turn)\n")
        print(table(header, rows) + "\n")

        if args.profile:

            def qspec_session(package: Path):
                def make(prefix: str, optimized: Path):
                    options = ort.SessionOptions()
                    options.intra_op_num_threads = args.threads
                    options.log_severity_level = 3
                    options.enable_profiling = True
                    options.profile_file_prefix = prefix
                    options.optimized_model_filepath = str(optimized)
                    options.add_session_config_entry(
                        "session.optimized_model_external_initializers_file_name", optimized.name + ".data"
                    )
                    options.add_free_dimension_override_by_name("ctx_len", qspec.model.kv_len)
                    path = package / qspec.model.manifest.runtime_graph.file
                    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                    return session, _rebind(qspec, session)

                return make

            def genai_session(prefix: str, optimized: Path):
                options = genai_options(args.threads, profile=prefix, optimized=optimized)
                call = GenaiCall(args.genai, args.threads, qspec.model.kv_len, options)
                return call.session, call

            packages = {"qspec": args.package}
            if args.no_pad_graph:
                packages["qspec no pad"] = calls["qspec no pad"].model.package
            if args.compare is not None:
                packages["qspec B"] = args.compare
            del calls  # the timing sessions' threads
            profiled = {name: profiled_session(qspec_session(path), work, name) for name, path in packages.items()}
            profiled["genai"] = profiled_session(genai_session, work, "genai")
            out["profile"] = profile_calls(profiled, positions, args.profile_calls)
            names = list(profiled)
            for p in positions:
                got = {name: out["profile"][name][p] for name in names}
                print(f"## Profile at position {p} (µs per call, median of {args.profile_calls} calls, interleaved)\n")
                rows = [[part, *(f"{got[n]['by_part'][part]:.0f}" for n in names)] for part in PARTS]
                rows.append(["sum of kernels", *(f"{got[n]['kernels_us']:.0f}" for n in names)])
                rows.append(["model_run (median)", *(f"{got[n]['model_run_us']:.0f}" for n in names)])
                rows.append(
                    [
                        "run - kernels (executor)",
                        *(f"{got[n]['model_run_us'] - got[n]['kernels_us']:.0f}" for n in names),
                    ]
                )
                rows.append(["nodes run", *(got[n]["nodes"] for n in names)])
                print(table(["part", *names], rows) + "\n")
                ops = sorted(
                    {op for n in names for op in got[n]["by_op"]}, key=lambda o: -got["qspec"]["by_op"].get(o, 0)
                )
                rows = [[op, *(f"{got[n]['by_op'].get(op, 0):.0f}" for n in names)] for op in ops]
                print(table(["op type (µs)", *names], rows) + "\n")

        if args.host:
            tokenizer = args.package / "tokenizer"
            engine = None
            host = {}
            for p in positions:
                prompt = prompt_of(tokenizer, p)
                q, engine = qspec_host(args.package, args.threads, prompt, args.new_tokens, engine)
                g = genai_host(args.genai, args.threads, prompt, args.new_tokens, work)
                host[p] = {"qspec": q, "genai": g}
            out["host"] = host
            rows = []
            for p, h in host.items():
                q, g = h["qspec"], h["genai"]
                rows.append(
                    [
                        p,
                        f"{q['step_ms']:.2f}",
                        f"{q['run_ms']:.2f}",
                        f"{q['host_ms']:.3f}",
                        f"{g['step_ms']:.2f}",
                        f"{g.get('run_ms', float('nan')):.2f}",
                        f"{g.get('host_ms', float('nan')):.3f}",
                        f"{q['step_ms'] / g['step_ms']:.3f}",
                        f"{q['ttft_ms']:.1f}",
                        f"{g['ttft_ms']:.1f}",
                    ]
                )
            print(f"## Decode loop, {args.new_tokens} tokens from a prompt of P tokens (median ms per step)\n")
            print(
                table(
                    [
                        "P",
                        "qspec step",
                        "qspec ORT run",
                        "qspec host",
                        "GenAI step",
                        "GenAI ORT run",
                        "GenAI host",
                        "qspec / GenAI step",
                        "qspec TTFT",
                        "GenAI TTFT",
                    ],
                    rows,
                )
                + "\n"
            )
        if args.json:
            args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def configured(qspec: QspecCall, threads: int, entries: dict[str, str]) -> QspecCall:
    """``qspec``'s call on a session of the same graph with the runtime's options plus ``entries``."""
    from qspec.backends import ort as ort_backend

    options = ort_backend.session_options({"ctx_len": qspec.model.kv_len}, spinning=True, num_threads=threads)
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    path = qspec.model.package / qspec.model.manifest.runtime_graph.file
    return _rebind(qspec, ort.InferenceSession(str(path), options, providers=ort_backend.PROVIDERS))


def _rebind(qspec: QspecCall, session: ort.InferenceSession) -> QspecCall:
    """A copy of ``qspec``'s K=0 call on ``session`` (its own KV buffers, same bound arrays)."""
    model = qspec.model
    other = QspecCall.__new__(QspecCall)
    other.model, other.k = model, 0
    other.bound = model._bind(model.decode_specs[0], session)
    other.session = session
    return other


if __name__ == "__main__":
    main()
