"""The peers' own model files, made once and cached: a Hugging Face folder and ONNX Runtime GenAI builds.

ONNX Runtime GenAI's model builder reads a Hugging Face folder (its GGUF reader takes fp16/fp32 files
only), so a ``.gguf`` model is first written out as one: transformers loads and dequantizes it, qspec's
loader forgets the quantizer (``save_pretrained`` fails otherwise), and the folder is saved. Then
``python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32|int4 -e cpu`` writes the graph.

Everything lives under ``<qspec cache>/peers/<model digest>/`` and is reused while the model's bytes
and the builder's version are the same. Each build keeps a ``qspec-build.json`` with the time the
builder took, so a cached build still reports it. A folder appears only when complete (written
next to it, then renamed), so an interrupted build is redone, never half-used.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from qspec.bench.report import PeerBuild
from qspec.errors import QSpecError

BUILD_RECORD = "qspec-build.json"
BUILDER_MODULE = "onnxruntime_genai.models.builder"
ORT_GENAI_PRECISIONS = ("fp32", "int4")
BUILD_TIMEOUT_S = 1800


class PeerUnavailable(QSpecError):
    """A peer runtime cannot run here; the message says why (the bench reports it and goes on)."""


def peers_root(digest: str) -> Path:
    """``<qspec cache>/peers/<first 16 hex of the model digest>``."""
    from qspec.export.exporter import cache_root

    return cache_root() / "peers" / digest[:16]


def folder_size_mb(folder: Path) -> float:
    return round(sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6, 1)


def read_build(folder: Path) -> PeerBuild | None:
    """The record of a complete build in ``folder``, marked as cached; None when there is none."""
    record = folder / BUILD_RECORD
    if not record.is_file():
        return None
    try:
        return PeerBuild.model_validate_json(record.read_text()).model_copy(update={"cached": True})
    except ValueError:
        return None  # an unreadable record: build again


def _finish(staging: Path, folder: Path, build: PeerBuild) -> PeerBuild:
    """Write the record into ``staging`` and move it to ``folder`` (replacing an incomplete one)."""
    (staging / BUILD_RECORD).write_text(build.model_dump_json(indent=2) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return build.model_copy(update={"folder": str(folder)})


def _staging(folder: Path) -> Path:
    staging = folder.with_name(folder.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    return staging


def write_hf_folder(gguf: str, folder: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it as a Hugging Face folder (weights + tokenizer)."""
    from qspec.export.loader import load_model, resolve_source

    model, tokenizer = load_model(resolve_source(gguf))  # the loader drops the GGUF quantizer
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _say_nothing(message: str) -> None:
    pass


def hf_folder(gguf: str, root: Path, say: Callable[[str], None] = _say_nothing) -> PeerBuild:
    """``root/hf``: the GGUF as a Hugging Face folder, made in a worker process (torch stays out of the bench)."""
    from qspec.bench.workers import Worker

    folder = root / "hf"
    cached = read_build(folder)
    if cached is not None:
        return cached
    say("writing the GGUF as a Hugging Face folder for ONNX Runtime GenAI's builder")
    staging = _staging(folder)
    begin = time.perf_counter()
    worker = Worker("peer_hf_folder", gguf, str(staging))
    try:
        worker.receive(f"writing {gguf} as a Hugging Face folder for ONNX Runtime GenAI's builder")
    finally:
        worker.close()
    build = PeerBuild(
        what="hf folder",
        folder=str(folder),
        build_s=round(time.perf_counter() - begin, 1),
        cached=False,
        size_mb=folder_size_mb(staging),
        command=f"transformers from_pretrained(gguf_file={Path(gguf).name}) + save_pretrained",
    )
    return _finish(staging, folder, build)


def builder_command(hf: Path, output: Path, precision: str, cache_dir: Path) -> list[str]:
    """The model builder's command line for a CPU graph at ``precision``."""
    return [
        sys.executable,
        "-m",
        BUILDER_MODULE,
        "-i",
        str(hf),
        "-o",
        str(output),
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        str(cache_dir),
    ]


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def build_ort_genai(
    hf: Path, precision: str, root: Path, version: str, say: Callable[[str], None] = _say_nothing
) -> PeerBuild:
    """``root/ort-genai-<version>-<precision>``: the model builder's CPU graph, built once and timed."""
    assert precision in ORT_GENAI_PRECISIONS, f"precision {precision!r} not in {ORT_GENAI_PRECISIONS}"
    folder = root / f"ort-genai-{version}-{precision}"
    cached = read_build(folder)
    if cached is not None:
        return cached
    say(f"ONNX Runtime GenAI's builder: the {precision} graph")
    staging = _staging(folder)
    command = builder_command(hf, staging, precision, root / "builder-cache")
    begin = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"ONNX Runtime GenAI's builder ({precision}) took over {BUILD_TIMEOUT_S} s") from None
    build_s = round(time.perf_counter() - begin, 1)
    if done.returncode != 0 or not (staging / "genai_config.json").is_file():
        raise PeerUnavailable(
            f"ONNX Runtime GenAI's builder ({precision}) failed (exit code {done.returncode}): "
            f"{_last_line(done.stderr or done.stdout)}"
        )
    shown = " ".join(["python", *command[1:]]).replace(str(staging), str(folder))
    build = PeerBuild(
        what=f"ort-genai {precision}",
        folder=str(folder),
        build_s=build_s,
        cached=False,
        size_mb=folder_size_mb(staging),
        command=shown,
    )
    return _finish(staging, folder, build)
