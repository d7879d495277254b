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
        (["--batch-size", "4", "--full-batch-size", "2"], ["--full-batch-size 2", "--batch-size 4"]),
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
    assert_one_line_error(
        result,
        "gpt2",
        "deepseek_v3, gemma2, gemma3_text, granite, llama, mistral, mixtral,",
        "olmo2, phi3, qwen2, qwen3, qwen3_moe",
    )
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


@pytest.fixture(scope="module")
def cli_package(tiny_model, tmp_path_factory):
    """A tiny llama package compiled by the CLI: K in [0, 4], ctx_len 64."""
    out = tmp_path_factory.mktemp("cli") / "pkg"
    result = qspec(
        "compile", str(tiny_model("llama")), "-k", "0,4", "--ctx-len", "64", "--prefill-seq-len", "8", "-o", str(out)
    )
    assert result.returncode == 0, result.stderr
    return out


def test_version_and_short_help():
    """`qspec --version` prints the version; `-h` is --help, on every command."""
    version = qspec("--version")
    assert version.returncode == 0 and version.stdout.startswith("qspec ")
    assert "Usage:" in qspec("-h").stdout and "--max-new-tokens" in qspec("generate", "-h").stdout


def test_brackets_survive_in_errors_and_help(tmp_path):
    """rich markup does not eat `[...]`: a path like run[fp16]/pkg stays whole in the one-line error (also
    when long and piped: no hard wrap), and help texts keep `qspec[peers]`."""
    folder = tmp_path / ("run[fp16]-" + "x" * 120) / "pkg"
    assert_one_line_error(qspec("generate", str(folder), "--prompt", "hi"), str(folder))
    assert "pip install 'qspec[peers]'" in " ".join(qspec("bench", "--help").stdout.split())


def test_package_files_follow_the_umask(cli_package):
    """Package files and folders get the user's umask (0644 / 0755 under 022), not tempfile's 0600 / 0700."""
    from qspec.common import current_umask

    mask = current_umask()
    assert cli_package.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (cli_package / "manifest.json").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (cli_package / "specializations.json").stat().st_mode & 0o777 == 0o666 & ~mask


def test_info_shows_what_a_package_holds(cli_package):
    """`qspec info` names the model, the K list, the specializations and the files with their sizes."""
    result = qspec("info", str(cli_package))
    assert result.returncode == 0, result.stderr
    assert "K                0,4" in result.stdout and "manifest.json" in result.stdout
    data = json.loads(qspec("info", str(cli_package), "--json").stdout)
    assert data["num_speculative_tokens"] == [0, 4] and data["ctx_len"] == 64 and len(data["specializations"]) == 3
    assert data["total_bytes"] == sum(data["files"].values()) > 0


def test_generate_options_newcomers_reach_for(cli_package, tmp_path):
    """--num-threads, ngram (pld's alias), messages lines and an empty --stop are taken; the summary labels
    its medians."""
    prompts = tmp_path / "p.jsonl"
    chat = {"messages": [{"role": "user", "content": "abab"}, {"role": "assistant", "content": "ab"}]}
    prompts.write_text(json.dumps(chat) + '\n{"turns": ["abcabc", "again"]}\n')
    args = ["--max-new-tokens", "6", "--num-threads", "1", "--method", "ngram", "--stop", ""]
    result = qspec("generate", str(cli_package), "--prompts-file", str(prompts), *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- ") == 2
    assert "TTFT (median)" in result.stderr and "TPOT (median)" in result.stderr
    assert "1 record(s)" in result.stderr  # the multi-turn record: only its first turn runs, and it says so
    data = json.loads(qspec("generate", str(cli_package), "-p", "abcabc", "--stop", "", "--json", *args[:2]).stdout)
    assert len(data["requests"][0]["token_ids"]) == 6  # an empty stop string ends nothing (as on the server)


def test_ignore_eos_generates_max_new_tokens(cli_package, tmp_path):
    """With the model's first greedy token made its EOS, generate stops after it; --ignore-eos runs all 6 tokens."""
    import shutil

    args = ["-p", "abcabc", "--max-new-tokens", "6", "--method", "none", "--json"]
    first = json.loads(qspec("generate", str(cli_package), *args).stdout)["requests"][0]["token_ids"][0]
    package = tmp_path / "pkg"
    shutil.copytree(cli_package, package, symlinks=True)
    manifest = json.loads((package / "manifest.json").read_text())
    manifest["model"]["eos_token_ids"] = [first]
    (package / "manifest.json").write_text(json.dumps(manifest))
    assert json.loads(qspec("generate", str(package), *args).stdout)["requests"][0]["token_ids"] == [first]
    fixed = json.loads(qspec("generate", str(package), *args, "--ignore-eos").stdout)["requests"][0]["token_ids"]
    assert len(fixed) == 6 and fixed[0] == first


def test_too_many_new_tokens_is_the_servers_error(cli_package):
    """prompt + --max-new-tokens past ctx_len is a one-line error naming both flags (the server's 400), and
    a too-long prompt's --ctx-len suggestion makes room for --max-new-tokens."""
    assert_one_line_error(
        qspec("generate", str(cli_package), "-p", "abc", "--max-new-tokens", "100"),
        "--max-new-tokens 100",
        "ctx_len 64",
        "--ctx-len",
    )
    long = qspec("generate", str(cli_package), "-p", "x" * 100, "--max-new-tokens", "300")
    assert_one_line_error(long, "ctx_len is 64")
    assert "--ctx-len 4" in long.stderr  # ~100 prompt tokens + 300: a 4xx suggestion


class _StoppedEngine:
    """An engine stand-in whose generate finishes request 1 of 3, then is interrupted (Ctrl-C)."""

    def generate(self, prompts, params, *, on_text=None, on_output=None):
        from qspec.runtime.metrics import RequestMetrics
        from qspec.runtime.request import RequestOutput

        on_output(RequestOutput(1, [5], [6, 7], "done", "length", RequestMetrics()))
        raise KeyboardInterrupt


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_keeps_the_finished_results(capsys, as_json):
    """Ctrl-C during generate --prompts-file: the finished request is printed (in the JSON too), exit 130."""
    import typer
    from qspec_cli.generate import _run_generate

    from qspec.runtime import SamplingParams

    with pytest.raises(typer.Exit) as stopped:
        _run_generate(_StoppedEngine(), [[1], [2], [3]], SamplingParams(), as_json=as_json)
    assert stopped.value.exit_code == 130
    out = capsys.readouterr()
    if as_json:
        data = json.loads(out.out)
        assert data["interrupted"] and [r["text"] for r in data["requests"]] == ["done"]
    else:
        assert out.out == "--- 1\ndone\n"
    assert "1 of 3 requests finished" in out.err


def test_errors_name_the_flags_not_the_fields(cli_package):
    """A bad value is reported under the flag the user typed (--max-new-tokens 0), not the library's field."""
    assert_one_line_error(
        qspec("generate", str(cli_package), "-p", "hi", "--max-new-tokens", "0"), "--max-new-tokens 0"
    )
    assert_one_line_error(qspec("generate", str(cli_package), "-p", "hi", "--temperature", "-1"), "--temperature -1.0")
    assert_one_line_error(qspec("specializations", "--prefill-seq-len", "256", "--ctx-len", "128"), "raise --ctx-len")
