"""``qspec compile MODEL --mtp`` and ``--method mtp`` end to end on tiny targets whose checkpoints ship MTP layers
(tests/mtp_checkpoints.py, ``predictive``: the even layers' drafts are accepted, the odd layers' mostly not):
greedy output equals ``none`` token for token, the vendor programs of every layer, the one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qspec.compile import CompileOptions, compile_package
from qspec.errors import ConfigError
from qspec.runtime import Engine, SamplingParams
from qspec.specializations import make_config
from tests.mtp_checkpoints import save_mtp_model

CTX = 256
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(30, 60)), [40, 41, 40, 41, 40], [100, 17, 3, 99, 250, 18]]
FAKE_COMPILER = Path(__file__).parent / "fake_qaic" / "qaic-compile"
FAMILY = {"deepseek": "llama", "mimo": "qwen2"}  # DeepSeek's naming over a Llama, MiMo over its Qwen2
# (layout, MTP layers, weight format, Ks, full_batch_size): each naming with 1 and 2 layers, fp32 and int4,
# K lists [0,4] and [0,1,2,4], one-slot (batch 1) and four-slot (batch 4, and batch 1 through max_batch_size).
PACKAGES = [
    ("deepseek", 1, "fp32", "0,1,2,4", 4),
    ("deepseek", 2, "fp32", "0,1,2,4", 4),
    ("mimo", 1, "fp32", "0,1,2,4", 4),
    ("mimo", 2, "fp32", "0,4", None),
    ("deepseek", 2, "int4", "0,4", None),
    ("mimo", 1, "int4", "0,1,2,4", 4),
]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    made = {}

    def make(layout: str, num_mtp: int):
        if (layout, num_mtp) not in made:
            folder = tmp_path_factory.mktemp(f"{layout}{num_mtp}")
            made[layout, num_mtp] = save_mtp_model(
                folder, layout, num_mtp=num_mtp, family=FAMILY[layout], predictive=True
            )
        return made[layout, num_mtp]

    return make


def compile_mtp(model, folder, *, ks: str, fbs: int | None = None, weight_format: str = "fp32", **options):
    spec = make_config(num_speculative_tokens=ks, prefill_seq_len=8, ctx_len=CTX, full_batch_size=fbs)
    options = CompileOptions(specialization=spec, weight_format=weight_format, mtp=True, **options)
    return compile_package(model, options, output=folder)


def run(package, *, n=24, **engine_options):
    engine = Engine(package, **engine_options)
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outputs], engine.last_metrics


@pytest.mark.parametrize(("layout", "num_mtp", "weight_format", "ks", "fbs"), PACKAGES)
def test_mtp_greedy_equals_none(mtp_model, tmp_path, layout, num_mtp, weight_format, ks, fbs):
    """``--method mtp`` gives ``none``'s tokens at every batch size and K list the package serves, drafts accepted;
    with no confidence threshold every layer drafts (the odd layers' drafts rejected), still ``none``'s tokens."""
    from qspec.head_manifest import read_head_manifest

    package, _, _ = compile_mtp(
        mtp_model(layout, num_mtp), tmp_path / "pkg", ks=ks, fbs=fbs, weight_format=weight_format
    )
    head = read_head_manifest(package)
    assert (head.method, head.layout, head.num_layers) == ("mtp", f"{layout}-mtp", num_mtp)
    plain, _ = run(package, method="none")
    runs = {"cover": dict(dispatch="cover"), "auto": dict(dispatch="auto"), "every layer": dict(dispatch="cover")}
    runs["every layer"]["draft_confidence_threshold"] = 0.0
    if fbs:
        runs["batch 1"] = dict(dispatch="cover", max_batch_size=1)
    if ks == "0,1,2,4":
        runs["K 0,4"] = dict(dispatch="cover", num_speculative_tokens="0,4")
    for name, options in runs.items():
        tokens, metrics = run(package, method="mtp", **options)
        assert tokens == plain, name
        assert metrics.accepted > 0, name
    _, deep = run(package, method="mtp", dispatch="cover", draft_confidence_threshold=0.0)
    _, sure = run(package, method="mtp", dispatch="cover")
    assert deep.proposed > sure.proposed  # the chain ran past the first layer's draft


def test_mtp_plus_prompt_lookup_equals_none(mtp_model, tmp_path):
    """``mtp+pld``: prompt lookup where it matches, the MTP layers elsewhere; ``none``'s tokens."""
    package, _, _ = compile_mtp(mtp_model("deepseek", 1), tmp_path / "pkg", ks="0,4")
    plain, _ = run(package, method="none")
    tokens, metrics = run(package, method="mtp+pld", dispatch="cover")
    assert tokens == plain and metrics.accepted > 0


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path: Path) -> str:
    """The stand-in qaic-compile first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    target = bin_dir / "qaic-compile"
    shutil.copy(FAKE_COMPILER, target)
    target.chmod(target.stat().st_mode | stat.S_IXUSR)
    monkeypatch.delenv("QAIC_COMPILE", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]))
    return str(target)


def test_qaic_mtp_programs(mtp_model, tmp_path, fake_compiler):
    """backend qaic: every MTP layer is a program of its own (head/, head/layer1/) with its custom IO (KV and
    features), named specializations (prefill, seq_len 1 and K + 1) and compile command; each compiles."""
    from qspec.head_manifest import read_head_manifest

    package, _, _ = compile_mtp(mtp_model("mimo", 2), tmp_path / "pkg", ks="0,1,4", backend="qaic", spec_format="named")
    head = read_head_manifest(package)
    assert head.method == "mtp" and head.num_layers == 2 and head.backend == "qaic"
    for folder in (package / "head", package / "head" / "layer1"):
        custom_io = (folder / "custom_io.yaml").read_text()
        for name in ("past_key.0", "past_value.0_RetainedState", "hidden_states", "hidden_states_out"):
            assert f"IOName: {name}\n" in custom_io
        script = (folder / "compile_qaic.sh").read_text()
        assert "-m=head.onnx" in script and "-network-specialization-config=specializations.json" in script
        assert "-custom-IO-list-file=custom_io.yaml" in script and "-retained-state" in script
        entries = json.loads((folder / "specializations.json").read_text())["specializations"]
        assert [e["name"] for e in entries] == ["Prefill", "Decode_0", "Decode_1", "Decode_2"]
        assert [e["symbols"]["seq_len"] for e in entries] == ["8", "1", "2", "5"]
        assert (folder / "head.onnx").is_file() and (folder / "qpc" / "programqpc.bin").is_file()


def test_compile_mtp_without_layers_is_one_line_error(tiny_model, tmp_path):
    """``qspec compile --mtp`` of a checkpoint without MTP layers: exit 1, one line naming the fix, no package."""
    from qspec_cli.main import app

    out = tmp_path / "pkg"
    result = CliRunner().invoke(app, ["compile", str(tiny_model("llama")), "--mtp", "-o", str(out)])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "has no MTP layers" in lines[0] and "drop --mtp" in lines[0], result.output
    assert not out.exists()


def test_mtp_method_without_mtp_layers_says_how(tiny_model, tmp_path):
    """``--method mtp`` on a package without MTP layers names ``--mtp``; ``--mtp`` with ``--draft-head`` is refused."""
    spec = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=CTX)
    package, _, _ = compile_package(tiny_model("llama"), CompileOptions(specialization=spec), output=tmp_path / "p")
    with pytest.raises(ConfigError, match="--mtp"):
        Engine(package, method="mtp")
    with pytest.raises(ValueError, match="not both"):
        CompileOptions(specialization=spec, mtp=True, draft_head=str(tmp_path))
