"""`qspec compile --backend qaic` on the command line: the vendor flags, what the output says, misuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FAKE = Path(__file__).parent / "fake_qaic"


def qspec(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qspec", *args], capture_output=True, text=True, env=env)


def compiler_env(tmp_path: Path) -> dict:
    """The stand-in qaic-compile first on PATH; no qaic-util anywhere (an SDK-less host)."""
    env = dict(os.environ, PATH=f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    env.pop("QAIC_COMPILE", None)
    return env


def test_qaic_flags_reach_the_command(tiny_model, tmp_path):
    """mxint8 KV, passthrough options and a user MDP file land in the package, its command and the output."""
    parts = tmp_path / "parts.json"
    parts.write_text('{"partitions": [{"name": "P0", "devices": [{"deviceId": 0, "numCores": 8}]}]}')
    out = tmp_path / "pkg"
    result = qspec(
        "compile", str(tiny_model("llama")), "-k", "0,4", "--ctx-len", "64", "--prefill-seq-len", "8",
        "--backend", "qaic", "--mxint8-kv-cache", "--qaic-option=-ols=2", "--qaic-option", "-allow-mxint8-mdp-io",
        "--mdp-config", str(parts), "-o", str(out),
        env=compiler_env(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    argv = json.loads((out / "manifest.json").read_text())["qaic"]["argv"]
    assert "-ols=2" in argv and "-allow-mxint8-mdp-io" in argv and "-mdp-load-partition-config=mdp.json" in argv
    assert "-compile-only" not in argv
    assert "Precision: mxint8" in (out / "custom_io.yaml").read_text()
    assert (out / "mdp.json").read_text() == parts.read_text()
    assert "qaic: -aic-hw-version=ai100, KV cache mxint8" in result.stdout
    assert "no qaic-util found" in result.stdout  # the default hardware version is said


def test_qaic_flags_without_qaic_backend_are_one_line_errors(tiny_model):
    """--mxfp6-matmul / --num-cores on the ort backend: one line naming the flags, nothing built."""
    result = qspec("compile", str(tiny_model("llama")), "--mxfp6-matmul", "--num-cores", "8")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    expected = "Error: --num-cores, --mxfp6-matmul: qaic-only; add --backend qaic, or drop them for the ort backend"
    assert errors == [expected]


def test_qaic_options_cannot_touch_an_ort_package(tmp_path):
    """The library refuses vendor options on the ort backend, and an ort package's inputs key leaves them out."""
    import pytest

    from qspec.backends.qaic import QaicOptions
    from qspec.compile import CompileOptions, _inputs_key
    from qspec.errors import ConfigError
    from qspec.specializations import make_config

    spec = make_config(num_speculative_tokens="0,4")
    with pytest.raises(ConfigError, match="num_cores=8: qaic-only; add --backend qaic, or drop it for the ort backend"):
        CompileOptions.create(specialization=spec, qaic=QaicOptions(num_cores=8))
    ort = CompileOptions(specialization=spec)
    assert _inputs_key("d", ort) == _inputs_key("d", ort.model_copy(update={"qaic": QaicOptions(num_cores=8)}))
    qaic_a = CompileOptions(specialization=spec, backend="qaic")
    qaic_b = CompileOptions(specialization=spec, backend="qaic", qaic=QaicOptions(num_cores=8))
    assert _inputs_key("d", qaic_a) != _inputs_key("d", qaic_b)  # a qaic package is rebuilt for new flags
    parts = tmp_path / "parts.json"
    parts.write_text('{"partitions": []}')
    with_mdp = CompileOptions(specialization=spec, backend="qaic", qaic=QaicOptions(mdp_config=str(parts)))
    before = _inputs_key("d", with_mdp)
    parts.write_text('{"partitions": [], "connections": []}')
    assert _inputs_key("d", with_mdp) != before  # an edited partition file rebuilds too
