"""Tests of qspec.backends.qaic: vendor files, command line, and a run of a stand-in compiler."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from qspec import contract
from qspec.backends import qaic, qaic_target
from qspec.backends.qaic import (
    QaicOptions,
    custom_io_yaml,
    find_compiler,
    mdp_partition_config,
    prepare_qaic,
    qaic_compile_argv,
)
from qspec.backends.qaic_target import (
    Precisions,
    detect_hw_version,
    hw_version_from_util_output,
    qefficient_precisions,
    resolve_precisions,
)
from qspec.errors import CompileError, ConfigError
from qspec.spec_file import write_specializations
from qspec.specializations import build_specializations, make_config

FAKE_COMPILER = Path(__file__).parent / "fake_qaic" / "qaic-compile"
NUM_LAYERS = 2


def write_tiny_onnx(path: Path, num_layers: int) -> None:
    """A structurally valid graph with the contract's names: KV passes through, logits from ids."""
    names = contract.input_names(num_layers, continuous_batching=False, speculative=True)
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in names[:3]]
    kv = contract.kv_names(num_layers)
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in kv]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in contract.output_names(num_layers)]
    cast = helper.make_node("Cast", [contract.INPUT_IDS], [contract.LOGITS], to=TensorProto.FLOAT)
    nodes = [cast]
    nodes += [helper.make_node("Identity", [n], [contract.retained(n)]) for n in kv]
    onnx.save(helper.make_model(helper.make_graph(nodes, "tiny", inputs, outputs)), path)


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A package directory with model.onnx (2 layers) and a flat specializations.json."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    write_tiny_onnx(pkg / "model.onnx", NUM_LAYERS)
    specs = build_specializations(make_config(num_speculative_tokens="0,4"))
    write_specializations(specs, pkg / "specializations.json")
    return pkg


@pytest.fixture
def no_compiler(monkeypatch, tmp_path: Path) -> None:
    """No compiler anywhere: empty PATH entry, no $QAIC_COMPILE, no SDK install."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.delenv(qaic.COMPILER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(qaic, "SDK_COMPILERS", (str(tmp_path / "opt" / "qaic-compile"),))
    monkeypatch.setattr(qaic_target, "SDK_UTIL", str(tmp_path / "opt" / "qaic-util"))


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path: Path, no_compiler) -> str:
    """The stand-in qaic-compile, copied executable into a bin dir put first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    target = bin_dir / "qaic-compile"
    shutil.copy(FAKE_COMPILER, target)
    target.chmod(target.stat().st_mode | stat.S_IXUSR)
    python_dir = Path(sys.executable).parent  # for the script's "#!/usr/bin/env python3"
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), os.environ["PATH"], str(python_dir)]))
    return str(target)


def prepare(package: Path, **overrides) -> dict:
    """prepare_qaic on the fixture package with default options, ``overrides`` applied."""
    kwargs = {
        "onnx_path": "model.onnx",
        "specializations_path": "specializations.json",
        "num_layers": NUM_LAYERS,
        "options": QaicOptions(),
    }
    return prepare_qaic(package, **{**kwargs, **overrides})


# --- vendor files -------------------------------------------------------------------------


def test_custom_io_two_layers_exact():
    """Two layers in QEfficient's order: per layer, key then value, each input before its _RetainedState."""
    expected = (
        " - IOName: past_key.0\n   Precision: float16\n\n"
        " - IOName: past_key.0_RetainedState\n   Precision: float16\n\n"
        " - IOName: past_value.0\n   Precision: float16\n\n"
        " - IOName: past_value.0_RetainedState\n   Precision: float16\n\n"
        " - IOName: past_key.1\n   Precision: float16\n\n"
        " - IOName: past_key.1_RetainedState\n   Precision: float16\n\n"
        " - IOName: past_value.1\n   Precision: float16\n\n"
        " - IOName: past_value.1_RetainedState\n   Precision: float16\n\n"
    )
    assert custom_io_yaml(2) == expected


def test_custom_io_is_yaml_list_with_dtype():
    """The custom IO text parses as a YAML list of {IOName, Precision}."""
    import yaml

    entries = yaml.safe_load(custom_io_yaml(1, kv_dtype="float32"))
    assert entries == [
        {"IOName": "past_key.0", "Precision": "float32"},
        {"IOName": "past_key.0_RetainedState", "Precision": "float32"},
        {"IOName": "past_value.0", "Precision": "float32"},
        {"IOName": "past_value.0_RetainedState", "Precision": "float32"},
    ]


def test_mdp_partition_config_spans_all_devices():
    """Two devices of 16 cores: one p2p connection and one partition holding both."""
    assert mdp_partition_config(2, 16) == {
        "connections": [{"devices": [0, 1], "type": "p2p"}],
        "partitions": [
            {
                "name": "Partition0",
                "devices": [{"deviceId": 0, "numCores": 16}, {"deviceId": 1, "numCores": 16}],
            }
        ],
    }


# --- options and command line --------------------------------------------------------------


def test_precisions_of_a_float32_network():
    """float32 network: -convert-to-fp16 and float16 KV (QEfficient); convert_to_fp16=False keeps float32 KV;
    fp16 KV without conversion is refused."""
    assert resolve_precisions(hw_version="ai100", graph_dtype="float32", mxint8_kv_cache=False) == Precisions(
        convert_to_fp16=True, kv_precision="float16", pass_custom_io=True
    )
    keep = resolve_precisions(hw_version="ai100", graph_dtype="float32", mxint8_kv_cache=False, convert_to_fp16=False)
    assert (keep.convert_to_fp16, keep.kv_precision) == (False, "float32")
    with pytest.raises(ConfigError, match="kv_dtype float16 needs convert_to_fp16=True"):
        QaicOptions.create(convert_to_fp16=False, kv_dtype="float16")


def test_precisions_mxint8_kv():
    """mxint8_kv_cache: custom IO mxint8, the network still converted to fp16, no compiler flag of its own."""
    precisions = resolve_precisions(hw_version="ai100", graph_dtype="float32", mxint8_kv_cache=True)
    assert precisions == Precisions(convert_to_fp16=True, kv_precision="mxint8", pass_custom_io=True)
    with pytest.raises(ConfigError, match="give mxint8_kv_cache or kv_dtype float16, not both"):
        QaicOptions.create(mxint8_kv_cache=True, kv_dtype="float16")


def test_precisions_bfloat16_on_ai200_only():
    """A bfloat16 network on ai200 keeps bfloat16 (no -convert-to-fp16) and the custom IO list is not passed;
    on ai100 it is refused; bfloat16 KV on qspec's float32 network is refused with the reason."""
    bf16 = qefficient_precisions(hw_version="ai200", graph_dtype="bfloat16", mxint8_kv_cache=False)
    assert bf16 == Precisions(convert_to_fp16=False, kv_precision="bfloat16", pass_custom_io=False)
    mx = qefficient_precisions(hw_version="ai200", graph_dtype="bfloat16", mxint8_kv_cache=True)
    assert mx == Precisions(convert_to_fp16=False, kv_precision="mxint8", pass_custom_io=True)
    with pytest.raises(ConfigError, match="needs -aic-hw-version=ai200"):
        qefficient_precisions(hw_version="ai100", graph_dtype="bfloat16", mxint8_kv_cache=False)
    with pytest.raises(ConfigError, match="kv_dtype bfloat16 needs a bfloat16 network"):
        resolve_precisions(hw_version="ai200", graph_dtype="float32", mxint8_kv_cache=False, kv_dtype="bfloat16")
    with pytest.raises(ConfigError, match="kv_dtype bfloat16 needs aic_hw_version ai200"):
        QaicOptions.create(aic_hw_version="ai100", kv_dtype="bfloat16")


def test_argv_bfloat16_network_skips_custom_io_and_fp16():
    """Network and KV bfloat16 (ai200): neither -convert-to-fp16 nor -custom-IO-list-file, as QEfficient."""
    bf16 = qefficient_precisions(hw_version="ai200", graph_dtype="bfloat16", mxint8_kv_cache=False)
    argv = qaic_compile_argv(
        compiler="c",
        onnx_path="m",
        specializations_path="s",
        custom_io_path="i",
        qpc_dir="q",
        options=QaicOptions(),
        hw_version="ai200",
        precisions=bf16,
    )
    assert argv == ["c", "-aic-hw", "-aic-hw-version=ai200", "-m=m", "-retained-state", "-aic-num-cores=16",
                    "-network-specialization-config=s", "-aic-binary-dir=q"]  # fmt: skip


# --- hardware version -----------------------------------------------------------------------


def fake_util(bin_dir: Path, variant: str) -> None:
    """A qaic-util stand-in printing one device with FW IMAGE_VARIANT ``variant``."""
    bin_dir.mkdir(exist_ok=True)
    util = bin_dir / "qaic-util"
    util.write_text(f"#!/bin/sh\necho 'QID 0'\necho '\tFW IMAGE_VARIANT:{variant}'\n")
    util.chmod(0o755)


def test_hw_version_from_util_output():
    """QEfficient's parse: AIC200 in the first FW IMAGE_VARIANT is ai200; anything else (or nothing) ai100."""
    assert hw_version_from_util_output("QID 0\n\tFW IMAGE_VARIANT:AIC200_CDH\n") == "ai200"
    assert hw_version_from_util_output("QID 0\n\tFW IMAGE_VARIANT : AIC100_PCIe\n") == "ai100"
    assert hw_version_from_util_output("") == "ai100"


def test_detect_hw_version(no_compiler, monkeypatch, tmp_path):
    """Given wins; else qaic-util decides; without qaic-util, ai100 and a message saying how to pick ai200."""
    assert detect_hw_version("ai200").source == "given"
    missing = detect_hw_version()
    assert (missing.version, missing.source) == ("ai100", "default")
    assert "no qaic-util found" in missing.message and "--aic-hw-version ai200" in missing.message
    fake_util(tmp_path / "util", "AIC200_X")
    monkeypatch.setenv("PATH", str(tmp_path / "util"))
    found = detect_hw_version()
    assert (found.version, found.source) == ("ai200", "qaic-util")


def test_options_errors_are_one_line():
    """Bad options become ConfigErrors naming the field and value."""
    with pytest.raises(ConfigError, match="num_cores=0"):
        QaicOptions.create(num_cores=0)
    with pytest.raises(ConfigError, match="unknown option cores=4"):
        QaicOptions.create(cores=4)


def test_argv_default_flags_in_order():
    """Default options, in QEfficient's order: fp16 conversion on, no mxfp6 / mos / depth-first / MDP,
    no -compile-only."""
    argv = qaic_compile_argv(
        compiler="qaic-compile",
        onnx_path="model.onnx",
        specializations_path="specializations.json",
        custom_io_path="custom_io.yaml",
        qpc_dir="qpc",
        options=QaicOptions(),
    )
    assert argv == [
        "qaic-compile",
        "-aic-hw",
        "-aic-hw-version=ai100",
        "-m=model.onnx",
        "-retained-state",
        "-convert-to-fp16",
        "-aic-num-cores=16",
        "-network-specialization-config=specializations.json",
        "-custom-IO-list-file=custom_io.yaml",
        "-aic-binary-dir=qpc",
    ]


def test_argv_all_optional_flags():
    """Every optional flag appears when enabled; the MDP template after the tuning flags, as QEfficient."""
    options = QaicOptions(
        aic_hw_version="ai200",
        num_cores=14,
        num_devices=2,
        mxfp6_matmul=True,
        mos=1,
        aic_enable_depth_first=True,
    )
    argv = qaic_compile_argv(
        compiler="/x/qaic-compile",
        onnx_path=Path("m.onnx"),
        specializations_path=Path("s.json"),
        custom_io_path=Path("io.yaml"),
        qpc_dir=Path("out"),
        options=options,
        mdp_path=Path("mdp.json"),
    )
    assert argv[1:] == [
        "-aic-hw",
        "-aic-hw-version=ai200",
        "-m=m.onnx",
        "-retained-state",
        "-convert-to-fp16",
        "-mxfp6-matmul",
        "-aic-num-cores=14",
        "-mos=1",
        "-aic-enable-depth-first",
        "-mdp-load-partition-config=mdp.json",
        "-network-specialization-config=s.json",
        "-custom-IO-list-file=io.yaml",
        "-aic-binary-dir=out",
    ]


def test_argv_compile_only_for_qaic_exec_only():
    """-compile-only goes to the deprecated qaic-exec (which also runs networks), never to qaic-compile."""
    paths = dict(onnx_path="m", specializations_path="s", custom_io_path="i", qpc_dir="q", options=QaicOptions())
    assert "-compile-only" not in qaic_compile_argv(compiler="/opt/qti-aic/exec/qaic-compile", **paths)
    assert qaic_compile_argv(compiler="/opt/qti-aic/exec/qaic-exec", **paths)[-1] == "-compile-only"


def test_fake_compiler_rejects_compile_only(package, fake_compiler):
    """The stand-in refuses -compile-only as current qaic-compile binaries do, so a test sees the drift."""
    argv = [fake_compiler, *prepare(package, run=False).argv[1:], "-compile-only"]
    result = subprocess.run(argv, cwd=package, capture_output=True, text=True)
    assert result.returncode == 1
    assert "-compile-only is no longer supported" in result.stderr


def test_fake_compiler_rejects_unknown_flag(package, fake_compiler):
    """An unknown flag fails the stand-in compile, named in the error."""
    argv = [fake_compiler, *prepare(package, run=False).argv[1:], "-no-such-flag"]
    result = subprocess.run(argv, cwd=package, capture_output=True, text=True)
    assert result.returncode == 1
    assert "unknown option '-no-such-flag'" in result.stderr


def test_argv_without_fp16_conversion():
    """convert_to_fp16=False drops the flag."""
    keep = resolve_precisions(hw_version="ai100", graph_dtype="float32", mxint8_kv_cache=False, convert_to_fp16=False)
    argv = qaic_compile_argv(
        compiler="c",
        onnx_path="m",
        specializations_path="s",
        custom_io_path="i",
        qpc_dir="q",
        options=QaicOptions(convert_to_fp16=False),
        precisions=keep,
    )
    assert "-convert-to-fp16" not in argv


def test_argv_compiler_options_verbatim_after_tuning_flags():
    """--qaic-option values go verbatim, in order, where QEfficient puts **compiler_options."""
    options = QaicOptions(mos=1, compiler_options=("-ols=2", "-allow-mxint8-mdp-io", "-node-precision-info=p.yaml"))
    argv = qaic_compile_argv(
        compiler="c", onnx_path="m", specializations_path="s", custom_io_path="i", qpc_dir="q", options=options
    )
    assert argv[argv.index("-mos=1") + 1 : argv.index("-network-specialization-config=s")] == [
        "-ols=2",
        "-allow-mxint8-mdp-io",
        "-node-precision-info=p.yaml",
    ]


def test_compiler_options_refused_with_the_fix():
    """A flag qspec sets itself names the qspec option; a flag without one dash is refused."""
    with pytest.raises(ConfigError, match="'-aic-num-cores=8': use --num-cores"):
        QaicOptions.create(compiler_options=["-aic-num-cores=8"])
    with pytest.raises(ConfigError, match="'-compile-only': qspec sets it"):
        QaicOptions.create(compiler_options=["-compile-only"])
    with pytest.raises(ConfigError, match="not -FLAG or -FLAG=VALUE"):
        QaicOptions.create(compiler_options=["--ols=2"])


def test_argv_user_mdp_after_model():
    """The user's partition file is passed right after -m, where QEfficient passes mdp_load_partition_config."""
    argv = qaic_compile_argv(
        compiler="c",
        onnx_path="m",
        specializations_path="s",
        custom_io_path="i",
        qpc_dir="q",
        options=QaicOptions(mdp_config="/home/me/parts.json"),
        mdp_path="mdp.json",
    )
    assert argv[3:5] == ["-m=m", "-mdp-load-partition-config=mdp.json"]


def test_argv_multi_device_needs_mdp_path():
    """num_devices > 1 without a partition config is refused."""
    with pytest.raises(ConfigError, match="num_devices 2 needs an MDP partition config"):
        qaic_compile_argv(
            compiler="c",
            onnx_path="m",
            specializations_path="s",
            custom_io_path="i",
            qpc_dir="q",
            options=QaicOptions(num_devices=2),
        )


# --- finding the compiler -----------------------------------------------------------------


def test_find_compiler_none(no_compiler):
    """Nothing on PATH, no env var, no SDK: None."""
    assert find_compiler() is None


def test_find_compiler_env_wins(fake_compiler, monkeypatch, tmp_path):
    """$QAIC_COMPILE is preferred over PATH."""
    other = tmp_path / "my-compiler"
    shutil.copy(fake_compiler, other)
    monkeypatch.setenv(qaic.COMPILER_ENV, str(other))
    assert find_compiler() == str(other)


def test_find_compiler_env_not_executable(monkeypatch, tmp_path):
    """$QAIC_COMPILE pointing nowhere is a ConfigError, not a silent fallback."""
    monkeypatch.setenv(qaic.COMPILER_ENV, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="is not an executable file"):
        find_compiler()


def test_find_compiler_on_path(fake_compiler):
    """qaic-compile on PATH is found."""
    assert find_compiler() == fake_compiler


def test_find_compiler_sdk_default(no_compiler, monkeypatch, fake_compiler):
    """Without env var or PATH entry, the SDK location is used when it exists."""
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(qaic, "SDK_COMPILERS", ("/nonexistent/qaic-compile", fake_compiler))
    assert find_compiler() == fake_compiler


# --- prepare_qaic -------------------------------------------------------------------------


def test_prepare_without_compiler_writes_script(package, no_compiler):
    """No compiler: custom_io.yaml and an executable compile_qaic.sh are written, nothing runs."""
    info = prepare(package, onnx_path=package / "model.onnx")  # absolute works too
    assert info.ran is False and info.compiler is None
    assert info.qpc_dir == "qpc" and info.custom_io == "custom_io.yaml"
    assert info.mdp_partition_config is None and not (package / "mdp.json").exists()
    assert info.argv[0] == "/opt/qti-aic/exec/qaic-compile"  # the SDK default
    assert "-m=model.onnx" in info.argv  # relative to the package
    assert (package / "custom_io.yaml").read_text() == custom_io_yaml(NUM_LAYERS)
    script = package / "compile_qaic.sh"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert 'cd "$(dirname "$0")"\n' in text
    assert '"${QAIC_COMPILE:-/opt/qti-aic/exec/qaic-compile}"' in text
    assert not (package / "qpc").exists()
    json.loads(info.model_dump_json())  # the manifest entry is JSON-serialisable


def test_prepare_run_true_without_compiler_fails(package, no_compiler):
    """run=True insists on a compiler and says how to provide one."""
    with pytest.raises(CompileError, match="set QAIC_COMPILE"):
        prepare(package, run=True)


def test_prepare_missing_onnx(package, no_compiler):
    """A missing ONNX file is named in a ConfigError."""
    with pytest.raises(ConfigError, match="other.onnx does not exist"):
        prepare(package, onnx_path="other.onnx")


def test_prepare_runs_compiler_on_path(package, fake_compiler):
    """With qaic-compile on PATH, prepare_qaic runs it in the package and the QPC appears."""
    info = prepare(package)
    assert info.ran is True and info.compiler == fake_compiler
    assert (package / "qpc" / "programqpc.bin").is_file()
    record = json.loads((package / "qpc" / "fake_qaic_argv.json").read_text())
    assert record["argv"] == info.argv[1:]
    assert Path(record["cwd"]) == package.resolve()


def test_prepare_run_false_does_not_run(package, fake_compiler):
    """run=False writes the files only, even when a compiler exists."""
    info = prepare(package, run=False)
    assert info.ran is False
    assert not (package / "qpc").exists()


def test_prepare_named_specializations_compile(package, fake_compiler):
    """The named form is accepted by the stand-in compiler too."""
    specs = build_specializations(make_config(num_speculative_tokens="0,4"))
    write_specializations(specs, package / "named.json", fmt="named")
    info = prepare(package, specializations_path="named.json")
    assert info.ran is True


def test_prepare_multi_device_writes_mdp(package, fake_compiler):
    """num_devices 2: mdp.json is written and passed to the compiler."""
    info = prepare(package, options=QaicOptions(num_devices=2, num_cores=8))
    assert info.mdp_partition_config == "mdp.json"
    assert json.loads((package / "mdp.json").read_text()) == mdp_partition_config(2, 8)
    assert "-mdp-load-partition-config=mdp.json" in info.argv


def test_script_runs_the_same_command(package, fake_compiler, monkeypatch):
    """compile_qaic.sh, run from elsewhere, compiles the package with the same command."""
    prepare(package, run=False)
    monkeypatch.setenv(qaic.COMPILER_ENV, fake_compiler)
    monkeypatch.setenv("PATH", os.pathsep.join([os.environ["PATH"], "/usr/bin", "/bin"]))  # dirname
    script = str(package / "compile_qaic.sh")
    result = subprocess.run([script], cwd="/", capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (package / "qpc" / "programqpc.bin").is_file()


def test_integer_valued_specializations_fail_with_exit_255(package, fake_compiler):
    """Integer values make the compiler exit 255: CompileError with the code and its stderr."""
    (package / "ints.json").write_text('{"specializations": [{"batch_size": 1, "seq_len": 32, "ctx_len": 128}]}\n')
    with pytest.raises(CompileError) as info:
        prepare(package, specializations_path="ints.json")
    message = str(info.value)
    assert "exit code 255" in message
    assert "batch_size must be a string" in message  # the tail of the compiler's stderr
    assert not (package / "qpc" / "programqpc.bin").exists()
    assert (package / "compile_qaic.sh").is_file()  # written before the run


def test_custom_io_missing_a_layer_fails(package, fake_compiler):
    """A graph with 3 layers compiled with a 2-layer custom IO list is refused by the compiler."""
    write_tiny_onnx(package / "model.onnx", 3)
    with pytest.raises(CompileError, match="past_key.2 of the network is missing"):
        prepare(package)


def test_fake_compiler_requires_retained_state(package, fake_compiler):
    """The stand-in refuses a command without -retained-state, as the real compiler would."""
    argv = [
        fake_compiler,
        "-m=model.onnx",
        "-network-specialization-config=specializations.json",
        "-custom-IO-list-file=custom_io.yaml",
        "-aic-binary-dir=qpc",
    ]
    (package / "custom_io.yaml").write_text(custom_io_yaml(NUM_LAYERS))
    result = subprocess.run(argv, cwd=package, capture_output=True, text=True)
    assert result.returncode == 1
    assert "-retained-state" in result.stderr


def test_prepare_mxint8_compiles(package, fake_compiler):
    """--mxint8-kv-cache: every KV input and retained-state output is mxint8; the stand-in compiles it."""
    info = prepare(package, options=QaicOptions(mxint8_kv_cache=True, mxfp6_matmul=True))
    assert info.ran and info.kv_precision == "mxint8"
    assert (package / "custom_io.yaml").read_text() == custom_io_yaml(NUM_LAYERS, kv_dtype="mxint8")
    assert "-mxfp6-matmul" in info.argv and "-convert-to-fp16" in info.argv
    assert not any("mxint8" in arg for arg in info.argv[1:])  # no flag: custom IO only, as QEfficient


def test_prepare_says_how_the_hw_version_was_picked(package, fake_compiler, tmp_path, monkeypatch):
    """No qaic-util: ai100 and a note; a qaic-util reporting AIC200: ai200 and a note on precisions."""
    info = prepare(package)
    assert info.aic_hw_version == "ai100" and "no qaic-util found" in info.notes[0]
    fake_util(tmp_path / "util", "AIC200")
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "util"), os.environ["PATH"]]))
    info = prepare(package)
    assert info.aic_hw_version == "ai200" and "-aic-hw-version=ai200" in info.argv
    assert "qaic-util" in info.notes[0] and "bfloat16 needs a bfloat16 export" in info.notes[1]
    assert prepare(package, options=QaicOptions(aic_hw_version="ai100")).notes == []


def test_prepare_user_mdp_copied_and_passed(package, fake_compiler, tmp_path):
    """--mdp-config: the user's file is copied into the package and wins over the template."""
    user = tmp_path / "parts.json"
    user.write_text('{"connections": [], "partitions": [{"name": "P", "devices": [{"deviceId": 3, "numCores": 4}]}]}')
    info = prepare(package, options=QaicOptions(mdp_config=str(user), num_devices=2))
    assert info.ran and info.mdp_partition_config == "mdp.json"
    assert (package / "mdp.json").read_text() == user.read_text()
    assert info.argv.count("-mdp-load-partition-config=mdp.json") == 1


def test_prepare_bad_user_mdp(package, no_compiler, tmp_path):
    """An unreadable or partition-less MDP file is a one-line ConfigError naming it."""
    with pytest.raises(ConfigError, match="cannot read it as JSON"):
        prepare(package, options=QaicOptions(mdp_config=str(tmp_path / "nope.json")))
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ConfigError, match="no 'partitions' list"):
        prepare(package, options=QaicOptions(mdp_config=str(tmp_path / "empty.json")))


def test_prepare_compiler_options_reach_the_compiler(package, fake_compiler):
    """Passthrough flags the real compiler knows compile; the stand-in records them verbatim."""
    info = prepare(package, options=QaicOptions(compiler_options=("-ols=2", "-allow-mxint8-mdp-io")))
    record = json.loads((package / "qpc" / "fake_qaic_argv.json").read_text())
    assert info.ran and "-ols=2" in record["argv"] and "-allow-mxint8-mdp-io" in record["argv"]


def test_prepare_lists_feature_outputs(package, fake_compiler):
    """A target graph with a hidden_states output lists it in custom IO (float16), and the stand-in, which
    finds it among the graph's names, compiles it; without the entry the stand-in refuses."""
    model = onnx.load(package / "model.onnx", load_external_data=False)  # the weights stay where they are
    model.graph.node.append(helper.make_node("Identity", [contract.LOGITS], [contract.HIDDEN_STATES]))
    model.graph.output.append(helper.make_tensor_value_info(contract.HIDDEN_STATES, TensorProto.FLOAT, None))
    onnx.save(model, package / "model.onnx")
    with pytest.raises(CompileError, match="hidden_states of the network is missing"):
        prepare(package)
    info = prepare(package, feature_outputs=(contract.HIDDEN_STATES,))
    assert info.ran
    assert (package / "custom_io.yaml").read_text().endswith(" - IOName: hidden_states\n   Precision: float16\n\n")
