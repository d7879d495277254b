"""The command line: commands exist, bad input is one line on stderr with exit 1, nothing half-written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def qspec(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qspec", *args], capture_output=True, text=True, cwd=cwd)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    # Progress lines may come first; the error itself is one line, and the last one.
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_help_lists_the_commands():
    """`python -m qspec --help` lists compile, specializations, generate and bench."""
    result = qspec("--help")
    assert result.returncode == 0
    for command in ("compile", "specializations", "generate", "bench"):
        assert command in result.stdout


def test_specializations_command_writes_the_vendor_format(tmp_path):
    """`qspec specializations` prints the flat string-valued file, sorted and de-duplicated."""
    result = qspec("specializations", "-k", "4,0,4", "--prefill-seq-len", "32", "--ctx-len", "128")
    assert result.returncode == 0, result.stderr
    specs = json.loads(result.stdout)["specializations"]
    assert [s["seq_len"] for s in specs] == ["32", "1", "5"]
    out = tmp_path / "specs.json"
    assert qspec("specializations", "-k", "0,4", "--spec-format", "named", "-o", str(out)).returncode == 0
    assert json.loads(out.read_text())["specializations"][2]["name"] == "Decode_1"  # QEfficient's names


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["-k", "0,a"], ["'a' is not an integer"]),
        (["-k", "4,,"], ["4,,"]),
        (["-k", "-1"], ["-1"]),
        (["-k", "200", "--ctx-len", "128"], ["200", "128"]),
        (["--prefill-seq-len", "256", "--ctx-len", "128"], ["256", "128"]),
        (["--batch-size", "4", "--full-batch-size", "2"], ["full_batch_size 2", "batch_size 4"]),
        (["--spec-format", "yaml"], ["yaml"]),
    ],
)
def test_bad_specialization_options_are_one_line_errors(args, fragments):
    """Each invalid option names its value, exits 1, and prints no traceback."""
    assert_one_line_error(qspec("specializations", *args), *fragments)


def test_unknown_flag_is_rejected():
    """A wrong flag is a usage error with a non-zero exit code."""
    result = qspec("specializations", "--num-speculative", "4")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr


def test_generate_on_a_missing_package(tmp_path):
    """A missing package directory names the path and the fix."""
    assert_one_line_error(
        qspec("generate", str(tmp_path / "nope"), "--prompt", "hi"), "does not exist", "qspec compile"
    )


def test_compile_unsupported_model_leaves_nothing(tmp_path):
    """An unsupported architecture fails with the supported list and writes no package."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(model_dir)
    out = tmp_path / "pkg"
    result = qspec("compile", str(model_dir), "-k", "0,4", "-o", str(out))
    assert_one_line_error(result, "gpt2", "llama, mistral, qwen2, qwen3")
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pkg")]  # no temporary leftovers


def test_compile_refuses_to_overwrite_a_foreign_folder(tiny_model, tmp_path):
    """--output pointing at a non-empty folder that is not a package is refused, the folder kept."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = qspec("compile", str(tiny_model("llama")), "-k", "0", "--ctx-len", "64", "-o", str(out))
    assert_one_line_error(result, "not a qspec package")
    assert (out / "notes.txt").read_text() == "keep me"


def test_compile_and_generate_end_to_end(tiny_model, tmp_path):
    """compile then generate --json on a tiny model; a too-long prompt is a clean error."""
    out = tmp_path / "pkg"
    result = qspec(
        "compile", str(tiny_model("llama")), "-k", "0,4", "--ctx-len", "64", "--prefill-seq-len", "8", "-o", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert (out / "manifest.json").is_file()
    gen = qspec("generate", str(out), "--prompt", "abcabcabc", "--max-new-tokens", "6", "--json")
    assert gen.returncode == 0, gen.stderr
    data = json.loads(gen.stdout)
    assert len(data["requests"][0]["token_ids"]) <= 6
    assert set(data["metrics"]["calls"]) == {"prefill", "0", "4"}
    long = qspec("generate", str(out), "--prompt", "x" * 100)
    assert_one_line_error(long, "ctx_len is 64")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abab"}\nnot json\n')
    assert_one_line_error(qspec("generate", str(out), "--prompts-file", str(prompts)), "p.jsonl:2")


def test_compile_qaic_backend_with_stand_in_compiler(tiny_model, tmp_path):
    """--backend qaic runs qaic-compile from PATH (a stand-in that checks its flags and files)."""
    import os
    from pathlib import Path

    fake = Path(__file__).parent / "fake_qaic"
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    env.pop("QAIC_COMPILE", None)
    out = tmp_path / "qaic-pkg"
    cmd = [
        sys.executable,
        "-m",
        "qspec",
        "compile",
        str(tiny_model("llama")),
        "-k",
        "0,4",
        "--ctx-len",
        "64",
        "--backend",
        "qaic",
        "--num-cores",
        "14",
        "--mxfp6-matmul",
        "-o",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["qaic"]["ran"] is True
    argv = manifest["qaic"]["argv"]
    assert "-retained-state" in argv and "-mxfp6-matmul" in argv and "-aic-num-cores=14" in argv
    assert (out / "custom_io.yaml").is_file() and (out / "compile_qaic.sh").is_file()
    assert (out / "qpc" / "programqpc.bin").is_file()


def test_identical_compile_is_reused(tiny_model, tmp_path):
    """A second compile with the same inputs reuses the package; other Ks rebuild it."""
    out = tmp_path / "pkg"
    base = ["compile", str(tiny_model("llama")), "--ctx-len", "64", "--prefill-seq-len", "8", "-o", str(out)]
    assert "wrote" in qspec(*base, "-k", "0,4").stdout
    assert "reused" in qspec(*base, "-k", "4,0").stdout  # same Ks after sorting
    rebuilt = qspec(*base, "-k", "0,2")
    assert "wrote" in rebuilt.stdout
    assert json.loads((out / "manifest.json").read_text())["config"]["num_speculative_tokens"] == [0, 2]
