"""Resident memory of a package loaded on ONNX Runtime, measured in a child process (``qspec info --memory``).

The child imports the runtime, notes its resident set, loads the package as ``qspec generate`` does (one
shared session, weights pre-packed, KV buffers allocated) and notes it again: the load's own bytes, apart
from the interpreter and the libraries, and the whole process's after load, as ``ps`` shows it.

    python -m qspec.runtime.memory PACKAGE   # prints one JSON line
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from qspec.errors import PackageError
from qspec.package import ResidentMemory


def _rss_bytes() -> int:
    """This process's resident set (``VmRSS``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def measure(package: str) -> ResidentMemory:
    """In this process: resident bytes before and after loading ``package`` (the runtime imported first)."""
    import onnxruntime  # noqa: F401

    from qspec.runtime.load import load_model

    before = _rss_bytes()
    begin = time.perf_counter()
    model = load_model(package)
    seconds = time.perf_counter() - begin
    after = _rss_bytes()
    itemsize = np.dtype(model.manifest.model.kv_dtype).itemsize
    kv = sum(int(np.prod(value.shape())) * itemsize for value in model.kv)  # [rows, kv_heads, kv_len, head_dim] each
    return ResidentMemory(process_bytes=after, load_bytes=after - before, kv_bytes=kv, load_seconds=round(seconds, 2))


def resident_after_load(package: str | Path) -> ResidentMemory:
    """:func:`measure` in a child process (this one keeps nothing loaded); a failed load is a one-line error."""
    result = subprocess.run(
        [sys.executable, "-m", "qspec.runtime.memory", str(package)], capture_output=True, text=True, check=False
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise PackageError(f"could not load {package} to measure its memory: {last}")
    return ResidentMemory.model_validate_json(lines[-1])


if __name__ == "__main__":
    print(measure(sys.argv[1]).model_dump_json())
