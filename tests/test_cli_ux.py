"""The second hour with the command line: chat by default, JSON lines, what `info` says about heads, the
edges a newcomer trips on (flags, help, errors), shipped heads and docs without machine paths."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tests.test_cli import assert_one_line_error, qspec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def package(tiny_model, tmp_path_factory):
    """A tiny llama package (K in [0, 4], ctx_len 1024) whose tokenizer has a chat template."""
    out = tmp_path_factory.mktemp("ux") / "pkg"
    result = qspec(
        "compile", str(tiny_model("llama")), "-k", "0,4", "--ctx-len", "1024", "--prefill-seq-len", "16", "-o", str(out)
    )
    assert result.returncode == 0, result.stderr
    return out


# --- chat by default ---------------------------------------------------------------------------------------


def test_generate_uses_the_chat_template_by_default(package, tmp_path):
    """A --prompt and a plain prompts-file line go through the chat template unless --no-chat; --chat stays."""
    from qspec.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(package / "tokenizer")
    chat_len, raw_len = len(tokenizer.encode_chat("abc")), len(tokenizer.encode("abc"))
    assert chat_len > raw_len

    def prompt_tokens(*args: str) -> list[int]:
        result = qspec("generate", str(package), *args, "--max-new-tokens", "2", "--json")
        assert result.returncode == 0, result.stderr
        return [r["prompt_tokens"] for r in json.loads(result.stdout)["requests"]]

    assert prompt_tokens("-p", "abc") == [chat_len]
    assert prompt_tokens("-p", "abc", "--chat") == [chat_len]
    assert prompt_tokens("-p", "abc", "--no-chat") == [raw_len]
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "abc"}\n"abc"\n')
    assert prompt_tokens("--prompts-file", str(lines)) == [chat_len, chat_len]
    assert prompt_tokens("--prompts-file", str(lines), "--no-chat") == [raw_len, raw_len]


class _Engine:
    """An engine stand-in: finishes the given outputs in order, then (optionally) is interrupted."""

    def __init__(self, *outputs, interrupt: bool = False):
        self.outputs, self.interrupt = outputs, interrupt
        from qspec.runtime.metrics import aggregate

        self.last_metrics = aggregate([o.metrics for o in outputs], 1.0, {"prefill": 1}, {})

    def generate(self, prompts, params, *, on_text=None, on_output=None):
        for output in self.outputs:
            on_output(output)
        if self.interrupt:
            raise KeyboardInterrupt


def _output(index: int, tokens: list[int], text: str, reason: str):
    from qspec.runtime.metrics import RequestMetrics
    from qspec.runtime.request import RequestOutput

    return RequestOutput(index, [5, 6], tokens, text, reason, RequestMetrics())


def test_a_request_ending_at_once_is_warned_about(capsys):
    """A request whose first token is end of sequence gets a warning naming the fix; one with text none."""
    from qspec_cli.generate import _run_generate

    from qspec.runtime import SamplingParams

    engine = _Engine(_output(0, [2], "", "stop"), _output(1, [7, 8], "hi", "stop"))
    _run_generate(engine, [[1], [2]], SamplingParams(), as_json=False, chat=False)
    err = capsys.readouterr().err
    assert "request 0 ended at once on end of sequence (try --chat)" in err and "request 1" not in err
    _run_generate(_Engine(_output(0, [], "", "stop")), [[1]], SamplingParams(), as_json=False, chat=True)
    assert "try --no-chat" in capsys.readouterr().err


# --- --jsonl -----------------------------------------------------------------------------------------------


def test_jsonl_prints_a_line_per_request_with_its_metrics(package, tmp_path):
    """--jsonl: one JSON object a line, one line per prompt, each with its token ids, text and metrics."""
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "abcabc"}\n{"prompt": "xyz"}\n')
    result = qspec("generate", str(package), "--prompts-file", str(lines), "--max-new-tokens", "5", "--jsonl")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(r["index"] for r in records) == [0, 1]
    assert all(r["token_ids"] and "ttft_ms" in json.dumps(r["metrics"]) for r in records)
    assert_one_line_error(qspec("generate", str(package), "-p", "a", "--json", "--jsonl"), "--jsonl")


def test_jsonl_keeps_every_finished_request_on_ctrl_c(capsys):
    """Ctrl-C after one of three requests: its line is out, exit 130."""
    import typer
    from qspec_cli.generate import _run_generate

    from qspec.runtime import SamplingParams

    with pytest.raises(typer.Exit) as stopped:
        _run_generate(
            _Engine(_output(1, [6, 7], "done", "length"), interrupt=True),
            [[1], [2], [3]],
            SamplingParams(),
            as_json=False,
            jsonl=True,
        )
    assert stopped.value.exit_code == 130
    out = capsys.readouterr()
    assert [json.loads(line)["text"] for line in out.out.splitlines()] == ["done"]
    assert "1 of 3 requests finished" in out.err


# --- qspec info --------------------------------------------------------------------------------------------


def test_info_says_head_hidden_states_and_methods(package):
    """A package without a head: no hidden states, no head, the model-free methods (not `user`)."""
    result = qspec("info", str(package))
    assert result.returncode == 0, result.stderr
    assert re.search(r"^hidden states +no$", result.stdout, re.M)
    assert re.search(r"^draft head +none", result.stdout, re.M)
    assert re.search(r"^methods +none, pld, suffix, draft$", result.stdout, re.M)
    data = json.loads(qspec("info", str(package), "--json").stdout)
    assert data["head"] is None and data["hidden_states"] is False
    assert data["methods"] == ["none", "pld", "suffix", "draft"]


def test_methods_a_head_adds():
    """A head adds its own method and its prompt-lookup combination, nothing of the other kind."""
    from qspec.package_info import accepted_methods

    assert accepted_methods("eagle")[-2:] == ["eagle", "eagle+pld"]
    assert accepted_methods("medusa")[-2:] == ["medusa", "medusa+pld"]


def test_info_describes_the_head():
    """The head line: kind, layout, draft vocabulary of the target's, weight format, and taps when present."""
    from qspec_cli.main import _describe_head

    head = {"kind": "eagle", "layout": "eagle", "draft_vocab_size": 4096, "vocab_size": 49152}
    assert _describe_head(head | {"weight_format": "int8"}) == (
        "eagle (eagle layout), draft vocabulary 4096 of 49152, int8"
    )
    assert _describe_head(head | {"weight_format": "fp32", "taps": [2, 15, 28]}).endswith("taps 2,15,28")


# --- command-line edges ------------------------------------------------------------------------------------


def test_debug_anywhere_on_the_command_line():
    """--debug after the subcommand's arguments shows the traceback (errors say "rerun with --debug")."""
    result = qspec("generate", "no-such-package", "--prompt", "hi", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr and "No such option" not in result.stderr


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["specializations", "--num-speculative", "4"], "--num-speculative"),
        (["generate"], "PACKAGE"),
        (["compile", "m", "--backend", "gpu"], "'gpu' is not one of 'ort', 'qaic'"),
        (["generate", "p", "--method", "user"], "'user' is not one of"),
    ],
)
def test_usage_errors_are_one_line_with_exit_1(args, fragment):
    """Unknown flags, missing arguments and bad choices: one `Error:` line naming the help, exit 1."""
    result = qspec(*args)
    assert result.returncode == 1
    assert_one_line_error(result, fragment, "-h` lists the options")


def test_help_shows_choices_not_placeholders():
    """Choices of --backend, --weight-format, --method in help; no `{model}` or `<list[str]>`; no `user`."""
    from qspec_cli.common import Method

    compile_help = qspec("compile", "-h").stdout
    assert "--backend <ort|qaic>" in compile_help and "--weight-format <fp32|int8|int4>" in compile_help
    generate_help = qspec("generate", "-h").stdout
    methods = re.search(r"--method <([^>]+)>", generate_help)
    assert methods and set(methods.group(1).split("|")) == set(typing.get_args(Method))
    for command in ("compile", "generate", "serve", "bench", "info", "chat", "train-head", "serve-load"):
        text = qspec(command, "-h").stdout
        assert "{" not in text.splitlines()[0] and "<list" not in text and "|user" not in text, command


def test_cli_choices_are_the_librarys():
    """The CLI's choice lists equal the library's names and aliases (user left out: it takes a Python callable)."""
    from qspec_cli.common import Backend, Method, WeightFormat

    from qspec import package
    from qspec.backends.registry import BACKENDS
    from qspec.runtime.load import RUNTIME_BACKENDS
    from qspec.runtime.proposers import METHOD_ALIASES, PROPOSER_METHODS

    assert set(typing.get_args(Method)) == (set(PROPOSER_METHODS) - {"user"}) | set(METHOD_ALIASES)
    assert typing.get_args(Backend) == tuple(BACKENDS) == RUNTIME_BACKENDS  # compile and runtime: the same names
    assert typing.get_args(WeightFormat) == typing.get_args(package.WeightFormat)


def test_a_fake_gguf_is_named_in_its_error(tmp_path):
    """A .gguf that is not one: the error names the file (not its folder), before any hashing."""
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf at all")
    assert_one_line_error(qspec("compile", str(fake), "-o", str(tmp_path / "pkg")), str(fake), "not a GGUF file")


@pytest.mark.parametrize("model_type,arch", [("bert", "BertModel"), ("gpt2", "GPT2LMHeadModel")])
def test_unsupported_family_is_refused_before_hashing(tmp_path, monkeypatch, model_type, arch):
    """A BERT or GPT-2 folder is refused from config.json: its files are never hashed or loaded."""
    from qspec.compile import CompileOptions, compile_package
    from qspec.errors import UnsupportedModelError
    from qspec.export import loader
    from qspec.specializations import make_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch]}))

    def no_hashing(source):
        raise AssertionError("hashed before the family was checked")

    monkeypatch.setattr(loader, "source_digest", no_hashing)
    with pytest.raises(UnsupportedModelError, match=f"'{model_type}'.*supported: .*llama"):
        options = CompileOptions(specialization=make_config(num_speculative_tokens="0,4", ctx_len=64))
        compile_package(tmp_path, options, output=tmp_path / "pkg")


def test_install_lists_every_data_folder_and_the_heads_extra():
    """Every folder of files under qspec/ is a listed package (setuptools warns about an unlisted one on each
    install), and the README's install line has the extra train-head needs."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    folders = {
        ".".join(p.relative_to(ROOT).parts)
        for p in (ROOT / "qspec").rglob("*")
        if p.is_dir() and p.name != "__pycache__" and any(f.is_file() for f in p.iterdir())
    }
    assert folders <= listed, folders - listed
    data = setup["package-data"]["qspec.data.mt_bench"]
    assert all(any(f.match(pattern) for pattern in data) for f in (ROOT / "qspec/data/mt_bench").iterdir())
    install = re.search(r"pip install -e '\.\[([a-z,]+)\]'", (ROOT / "README.md").read_text())
    assert install and "heads" in install.group(1).split(",")


def test_train_head_help_gives_a_quick_setting_and_the_time():
    """`train-head -h` says how long the defaults take and shows a quick setting with its time."""
    text = " ".join(qspec("train-head", "-h").stdout.split())
    assert "hours" in text and "Quick:" in text and "--epochs 1" in text and "minutes" in text


# --- shipped heads -----------------------------------------------------------------------------------------


def _machine_paths(value) -> list[str]:
    if isinstance(value, dict):
        return [p for v in value.values() for p in _machine_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _machine_paths(v)]
    return [value] if isinstance(value, str) and re.match(r"^(/|~|[A-Za-z]:\\)", value) else []


@pytest.mark.parametrize("config", sorted((ROOT / "heads").glob("*/config.json")), ids=lambda p: p.parent.name)
def test_shipped_head_configs_are_clean(config):
    """A shipped head's config.json: no machine path, no transformers boilerplate, one dtype, and the draft
    vocabulary its weights have."""
    from safetensors import safe_open

    from qspec.heads.checkpoint import clean_config

    values = json.loads(config.read_text())
    assert not _machine_paths(values)
    assert clean_config(values) == values  # no _name_or_path, transformers_version, dtype, id2label, ...
    weights = config.parent / "model.safetensors"
    if "draft_vocab_size" in values and weights.is_file():
        with safe_open(weights, "np") as handle:
            assert handle.get_slice("d2t").get_shape() == [values["draft_vocab_size"]]
        readme = (ROOT / "heads" / "README.md").read_text()
        assert f"{values['draft_vocab_size']:,}-token draft vocabulary" in readme


def test_a_trained_head_records_no_machine_path(tiny_model, tmp_path):
    """save_eagle of a head made from a model loaded from a folder writes neither the folder nor boilerplate."""
    import torch
    from transformers import AutoModelForCausalLM

    from qspec.heads import modules

    target = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    out = modules.save_eagle(modules.eagle_from_target(target), tmp_path / "head")
    values = json.loads((out / "config.json").read_text())
    assert not _machine_paths(values) and str(tiny_model("llama")) not in json.dumps(values)
    assert "transformers_version" not in values and "dtype" not in values and values["torch_dtype"] == "float16"
    assert modules.load_eagle(out, target).config.hidden_size == target.config.hidden_size


def test_qaic_compile_with_a_head_prints_both_scripts(tiny_model, tmp_path):
    """--backend qaic with a head and no qaic-compile: both compile_qaic.sh are printed, the target's first."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from qspec.heads import modules

    target = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    head = modules.save_eagle(modules.eagle_from_target(target), tmp_path / "head")
    out = tmp_path / "pkg"
    env = {k: v for k, v in os.environ.items() if k != "QAIC_COMPILE"}
    env["PATH"] = str(Path(sys.executable).parent)  # no qaic-compile on it
    args = ["compile", str(tiny_model("llama")), "-k", "0,4", "--ctx-len", "64", "--backend", "qaic"]
    result = subprocess.run(
        [sys.executable, "-m", "qspec", *args, "--draft-head", str(head), "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert f"run {out / 'compile_qaic.sh'} then {out / 'head' / 'compile_qaic.sh'}" in result.stdout
    assert (out / "head" / "compile_qaic.sh").is_file()


# --- docs --------------------------------------------------------------------------------------------------

# The vendor SDK's install location, which docs/qaic.md names as the place its tools are looked for.
VENDOR_PATHS = ("/opt/qti-aic",)
ABSOLUTE = re.compile(r"(?<![\w.~/:-])/(?:home|root|tmp|work|usr|var|mnt|opt|Users|private)/[\w.+-]+")


def test_no_absolute_paths_under_docs():
    """No file under docs/ (reports included) holds a path of the machine it was written on."""
    found = []
    for path in sorted((ROOT / "docs").rglob("*")):
        if path.is_file() and path.suffix in (".md", ".json", ".txt", ".csv"):
            for match in ABSOLUTE.finditer(path.read_text(errors="replace")):
                if not match.group().startswith(VENDOR_PATHS):
                    found.append(f"{path.relative_to(ROOT)}: {match.group()}")
    assert not found, found[:10]


RUN_LOG = re.compile(r"\bstop \d+\b|\bthe stop before\b|\bthe issue'?s?\b|\bthis session\b", re.I)


def test_reference_pages_read_as_references():
    """README, heads/README.md and docs/*.md (not the notebooks under docs/bench/) carry no run-log words."""
    pages = [ROOT / "README.md", ROOT / "heads" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{p.relative_to(ROOT)}: {m.group()}" for p in pages for m in RUN_LOG.finditer(p.read_text())]
    assert not found, found


def test_cli_reference_is_current():
    """docs/cli.md's "Every command" section is the commands' help as it is now (python -m qspec_cli.reference)."""
    from qspec_cli.reference import render

    page = (ROOT / "docs" / "cli.md").read_text()
    assert page == render(page), "docs/cli.md is stale: run `python -m qspec_cli.reference`"


# --- qspec chat, typed at a terminal -----------------------------------------------------------------------


def test_chat_on_a_terminal(package):
    """`qspec chat` under a pseudo-terminal, as a person types: answers stream, the history is kept and sized,
    Ctrl-C during an answer and at the prompt keeps the conversation, /reset forgets it, /exit leaves (exit 0)."""
    pexpect = pytest.importorskip("pexpect")
    import os

    env = dict(os.environ, TERM="dumb", COLUMNS="200")
    env.pop("QSPEC_DEBUG", None)
    args = ["-m", "qspec", "chat", str(package), "--method", "none", "--max-new-tokens", "600", "--no-stats"]
    every_core = lambda: os.sched_setaffinity(0, range(os.cpu_count()))  # noqa: E731 (not an xdist worker's one core)
    child = pexpect.spawn(
        sys.executable, args, env=env, encoding="utf-8", codec_errors="replace", timeout=120, preexec_fn=every_core
    )
    child.expect_exact(">>> ")
    child.sendline("abcabc")
    child.expect_exact(">>> ")  # the answer streamed (the random model ends on EOS after a few hundred tokens)
    child.sendline("/history")
    child.expect(r"2 message\(s\), (\d+) tokens in the context")
    first = int(child.match.group(1))
    child.sendline("xyz")
    child.expect_exact("xyz\r\n")  # the echo; then the answer's first characters, and Ctrl-C while it streams
    child.expect(r"\S")
    child.sendintr()
    child.expect_exact("(answer stopped)")
    child.expect_exact(">>> ")
    child.sendintr()  # Ctrl-C at the prompt: a hint, not an exit
    child.expect_exact("/exit (or Ctrl-D) leaves")
    child.sendline("/history")
    child.expect(r"4 message\(s\), (\d+) tokens in the context")
    assert int(child.match.group(1)) > first  # the first turn is still in the context
    child.sendline("/reset")
    child.expect_exact("conversation reset")
    child.sendline("/history")
    child.expect_exact("0 message(s), ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_conversation_drops_the_oldest_turns_to_fit(tmp_path):
    """The oldest user/assistant pair goes first when the next answer would not fit; a lone message too long
    is an error that leaves the conversation without it."""
    from qspec.errors import ConfigError
    from qspec.runtime.conversation import Conversation
    from qspec.runtime.tokenizer import Tokenizer
    from tests.conftest import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    chat = Conversation(system="s")
    for turn in ("a" * 20, "b" * 20, "c" * 20):
        chat.add("user", turn)
        chat.add("assistant", turn.upper())
    chat.add("user", "d")
    whole = len(tokenizer.encode_chat(chat.messages))
    ids, dropped = chat.prompt_ids(tokenizer, ctx_len=whole + 10, max_new_tokens=10)
    assert dropped == 0 and len(ids) == whole
    ids, dropped = chat.prompt_ids(tokenizer, ctx_len=whole, max_new_tokens=10)
    assert dropped == 1 and chat.turns[0]["content"] == "b" * 20 and chat.messages[0]["role"] == "system"
    chat.reset()
    chat.add("user", "x" * 100)
    with pytest.raises(ConfigError, match="does not fit"):
        chat.prompt_ids(tokenizer, ctx_len=64, max_new_tokens=10)
    assert chat.turns == []


def test_serving_page_lists_every_method():
    """docs/serving.md names every method `qspec serve --method` takes."""
    from qspec_cli.common import Method

    text = (ROOT / "docs" / "serving.md").read_text()
    assert all(f"`{m}`" in text for m in typing.get_args(Method)), [
        m for m in typing.get_args(Method) if f"`{m}`" not in text
    ]
