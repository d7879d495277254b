"""What a verify call of S = K + 1 tokens costs against a one-token call: qspec's runtime graph and ONNX Runtime
GenAI's graph of the same model, side by side.

Every call of each graph at each width, one after another in a shuffled order, ``--iterations`` times per
position, in one process with neither session's threads spinning (an idle spinning pool would steal the
cores of the session that runs). qspec's calls are the engine's own bindings (each compiled K); GenAI's graph
runs in a plain ORT session as GenAI binds it (past and present one buffer, ``attention_mask`` of P + S ones).

Usage::

    python scripts/verify_cost.py PACKAGE GENAI_DIR --positions 100,400,800 --threads 2

``PACKAGE``: a package compiled with the Ks to price (``-k 0,1,2,4``); ``GENAI_DIR``: GenAI's model builder's
folder of the same weight format (``<qspec cache>/peers/<digest>/ort-genai-<version>-int4``, made by
``qspec bench``). Prints a markdown table: median ms per call, and its ratio to the same graph's S = 1.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from statistics import median

import numpy as np
import onnxruntime as ort

from qspec.runtime.load import load_model


class GenaiCalls:
    """GenAI's decoder graph in one ORT session: a binding per (width, position), KV bound in place."""

    def __init__(self, folder: Path, threads: int, kv_len: int):
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        decoder = config["decoder"]
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            str(folder / decoder["filename"]), options, providers=["CPUExecutionProvider"]
        )
        self.names, self.vocab, self.layers = (
            (decoder["inputs"], decoder["outputs"]),
            config["vocab_size"],
            decoder["num_hidden_layers"],
        )
        shape = (1, decoder["num_key_value_heads"], kv_len, decoder["head_size"])
        self.kv = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for _ in range(2 * self.layers)]

    def call(self, width: int, position: int):
        inputs, outputs = self.names
        binding = self.session.io_binding()
        arrays = (np.full((1, width), 100, np.int64), np.ones((1, position + width), np.int64))
        keep = [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
        keep.append(ort.OrtValue.ortvalue_from_numpy(np.zeros((1, width, self.vocab), np.float32)))
        binding.bind_ortvalue_input(inputs["input_ids"], keep[0])
        binding.bind_ortvalue_input(inputs["attention_mask"], keep[1])
        binding.bind_ortvalue_output(outputs["logits"], keep[2])
        for layer in range(self.layers):
            for j, kind in enumerate(("key", "value")):
                binding.bind_ortvalue_input(inputs[f"past_{kind}_names"] % layer, self.kv[2 * layer + j])
                binding.bind_ortvalue_output(outputs[f"present_{kind}_names"] % layer, self.kv[2 * layer + j])
        return lambda: (keep, self.session.run_with_iobinding(binding))


def qspec_call(model, k: int, position: int):
    """The engine's binding of K: one live row of ``k + 1`` tokens at ``position``."""
    bound = model.decode[k]

    def run() -> None:
        bound.reset()
        bound.position_ids[:, : k + 1] = np.arange(position, position + k + 1)
        bound.input_ids[:, : k + 1] = 100
        model.run(bound)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("genai", type=Path)
    parser.add_argument("--positions", default="100,400,800")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=100)
    args = parser.parse_args()
    model = load_model(args.package, num_threads=args.threads, spinning=False)
    model.warm_up()
    ks = sorted(model.decode)
    genai = GenaiCalls(args.genai, args.threads, model.kv_len)
    columns = [f"{who} S={k + 1}" for k in ks for who in ("qspec", "GenAI")]
    print("| position | " + " | ".join(columns) + " | qspec / GenAI, S=1 |")
    print("|---" * (2 * len(ks) + 2) + "|")
    for position in map(int, args.positions.split(",")):
        calls = {("qspec", k): qspec_call(model, k, position) for k in ks}
        calls |= {("genai", k): genai.call(k + 1, position) for k in ks}
        took = {name: [] for name in calls}
        order = list(calls.items())
        for _ in range(3):
            for _, run in order:
                run()
        for _ in range(args.iterations):
            random.shuffle(order)
            for name, run in order:
                begin = time.perf_counter()
                run()
                took[name].append((time.perf_counter() - begin) * 1000)
        ms = {name: median(values) for name, values in took.items()}
        cells = [
            f"{ms[(who, k)]:.2f} ({ms[(who, k)] / ms[(who, ks[0])]:.2f})" for k in ks for who in ("qspec", "genai")
        ]
        ratio = ms[("qspec", ks[0])] / ms[("genai", ks[0])]
        print(f"| {position} | " + " | ".join(cells) + f" | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
