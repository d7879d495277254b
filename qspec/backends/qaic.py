"""Qualcomm Cloud AI 100 backend: the vendor compiler's input files and command line.

The vendor compiler (``qaic-compile``, formerly ``qaic-exec``) turns ``model.onnx`` plus the
specializations file into a QPC. qspec writes, into the package directory:

- ``custom_io.yaml``: the precision of every ``past_key.{i}`` / ``past_value.{i}`` input and of its
  ``_RetainedState`` twin (QEfficient's format), so the KV cache stays in ``kv_dtype`` on device;
- ``mdp.json``: a one-partition multi-device (tensor-slicing) config, only when ``num_devices > 1``;
- ``compile_qaic.sh``: the exact command line, paths relative to the package directory, so the
  package can be compiled later on a machine with the SDK.

When a compiler is found (``$QAIC_COMPILE``, ``qaic-compile`` on ``PATH``, or the SDK's default
location) :func:`prepare_qaic` also runs it; the QPC lands in ``<package>/qpc``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

from qspec import contract
from qspec.backend_records import GraphDtype, HwVersion, QaicOptions, QaicResult
from qspec.backends.qaic_target import (
    DEFAULT_HW_VERSION,
    HwDetection,
    Precisions,
    detect_hw_version,
    resolve_precisions,
)
from qspec.common import write_text_atomic
from qspec.errors import CompileError, ConfigError

COMPILER_ENV = "QAIC_COMPILE"
COMPILER_NAME = "qaic-compile"
DEFAULT_COMPILER = "/opt/qti-aic/exec/qaic-compile"  # where the SDK installs it
LEGACY_COMPILER_NAME = "qaic-exec"  # the SDK's older compile-and-run tool
SDK_COMPILERS = (DEFAULT_COMPILER, f"/opt/qti-aic/exec/{LEGACY_COMPILER_NAME}")

QPC_DIR = "qpc"
QPC_PROGRAM = "programqpc.bin"  # what a successful compile leaves in QPC_DIR
CUSTOM_IO_FILE = "custom_io.yaml"
MDP_FILE = "mdp.json"
SCRIPT_FILE = "compile_qaic.sh"
STDERR_TAIL_LINES = 20

# --------------------------------------------------------------------------------------------
# Vendor files
# --------------------------------------------------------------------------------------------


def custom_io_yaml(num_layers: int, *, kv_dtype: str = "float16", latent: bool = False) -> str:
    """QEfficient's custom IO list: per layer, each KV input followed by its ``_RetainedState`` output.

    For one layer::

         - IOName: past_key.0
           Precision: float16

         - IOName: past_key.0_RetainedState
           Precision: float16

         - IOName: past_value.0
           Precision: float16

         - IOName: past_value.0_RetainedState
           Precision: float16

    With ``latent`` (DeepSeek-V3's compressed cache) the buffers are ``compressed_kv.{i}`` and ``k_pe.{i}``, as
    QEfficient names them.
    """
    names = [n for name in contract.kv_names(num_layers, latent=latent) for n in (name, contract.retained(name))]
    return "".join(f" - IOName: {name}\n   Precision: {kv_dtype}\n\n" for name in names)


def mdp_partition_config(num_devices: int, num_cores: int) -> dict[str, Any]:
    """Multi-device tensor-slicing config: one partition spanning every device (as QEfficient)."""
    devices = list(range(num_devices))
    return {
        "connections": [{"devices": devices, "type": "p2p"}],
        "partitions": [
            {
                "name": "Partition0",
                "devices": [{"deviceId": d, "numCores": num_cores} for d in devices],
            }
        ],
    }


FP32_ON_AI100 = Precisions(convert_to_fp16=True, kv_precision="float16", pass_custom_io=True)


def qaic_compile_argv(
    *,
    compiler: str,
    onnx_path: str | os.PathLike[str],
    specializations_path: str | os.PathLike[str],
    custom_io_path: str | os.PathLike[str],
    qpc_dir: str | os.PathLike[str],
    options: QaicOptions,
    hw_version: HwVersion | None = None,
    precisions: Precisions = FP32_ON_AI100,
    mdp_path: str | os.PathLike[str] | None = None,
) -> list[str]:
    """The compiler's command line, in the order QEfficient's ``_compile`` builds it.

    ``hw_version`` defaults to ``options.aic_hw_version`` (else ai100); ``precisions`` to a float32
    network's. ``mdp_path``, required when ``num_devices > 1``: the user's file
    (``options.mdp_config``) comes right after ``-m``, the template after the tuning flags, as in
    QEfficient. ``-compile-only`` is not passed: current ``qaic-compile`` binaries reject it
    (QEfficient removed it in 1.22); only the deprecated ``qaic-exec``, which also runs networks,
    needs it to stop after compiling.
    """
    if options.num_devices > 1 and mdp_path is None:
        raise ConfigError(
            f"num_devices {options.num_devices} needs an MDP partition config; pass mdp_path (prepare_qaic writes one)"
        )
    mdp = [f"-mdp-load-partition-config={os.fspath(mdp_path)}"] if mdp_path is not None else []
    user_mdp = options.mdp_config is not None
    argv = [
        compiler,
        "-aic-hw",
        f"-aic-hw-version={hw_version or options.aic_hw_version or DEFAULT_HW_VERSION}",
        f"-m={os.fspath(onnx_path)}",
        *(mdp if user_mdp else []),
        "-retained-state",
    ]
    if precisions.convert_to_fp16:
        argv.append("-convert-to-fp16")
    if options.mxfp6_matmul:
        argv.append("-mxfp6-matmul")
    argv.append(f"-aic-num-cores={options.num_cores}")
    if options.mos is not None:
        argv.append(f"-mos={options.mos}")
    if options.aic_enable_depth_first:
        argv.append("-aic-enable-depth-first")
    argv += options.compiler_options
    argv += [] if user_mdp else mdp
    argv.append(f"-network-specialization-config={os.fspath(specializations_path)}")
    if precisions.pass_custom_io:
        argv.append(f"-custom-IO-list-file={os.fspath(custom_io_path)}")
    argv.append(f"-aic-binary-dir={os.fspath(qpc_dir)}")
    if Path(compiler).name == LEGACY_COMPILER_NAME:
        argv.append("-compile-only")  # qaic-exec compiles and runs; this makes it only compile
    return argv


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_compiler() -> str | None:
    """``$QAIC_COMPILE``, else ``qaic-compile`` on PATH, else the SDK's default paths; or None."""
    from_env = os.environ.get(COMPILER_ENV)
    if from_env:
        if not _is_executable(from_env):
            raise ConfigError(
                f"{COMPILER_ENV}={from_env} is not an executable file; point it to qaic-compile or unset it"
            )
        return from_env
    on_path = shutil.which(COMPILER_NAME)
    if on_path:
        return on_path
    return next((path for path in SDK_COMPILERS if _is_executable(path)), None)


def compile_script(argv: list[str]) -> str:
    """A POSIX shell script running ``argv`` from its own directory; ``$QAIC_COMPILE`` wins."""
    compiler = f'"${{{COMPILER_ENV}:-{argv[0]}}}"'
    args = " \\\n  ".join(shlex.quote(arg) for arg in argv[1:])
    return (
        "#!/bin/sh\n"
        "# Compiles this qspec package for Qualcomm Cloud AI 100 into qpc/.\n"
        f"# Set {COMPILER_ENV} to use another compiler binary.\n"
        "set -eu\n"
        'cd "$(dirname "$0")"\n'
        f"exec {compiler} \\\n  {args}\n"
    )


def _relative(path: str | os.PathLike[str], package_dir: Path) -> str:
    """``path`` (absolute, or relative to the package) relative to the package directory."""
    path = Path(path)
    if not path.is_absolute():
        path = package_dir / path
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; export the model and write specializations first")
    return os.path.relpath(path, package_dir)


def write_executable(path: Path, text: str) -> None:
    write_text_atomic(path, text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


# --------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------


def _stderr_tail(text: str) -> str:
    lines = text.strip().splitlines()[-STDERR_TAIL_LINES:]
    return "\n".join(lines) if lines else "(no output on stderr)"


def run_compiler(argv: list[str], *, cwd: Path) -> None:
    """Run the compiler in ``cwd``; CompileError with its exit code and stderr tail on failure."""
    qpc = cwd / QPC_DIR
    shutil.rmtree(qpc, ignore_errors=True)  # a stale programqpc.bin must not pass for a new one
    try:
        result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise CompileError(f"cannot run {argv[0]}: {exc}") from None
    if result.returncode != 0:
        raise CompileError(
            f"{argv[0]} failed with exit code {result.returncode} (command in {SCRIPT_FILE}):\n"
            f"{_stderr_tail(result.stderr)}"
        )
    if not (qpc / QPC_PROGRAM).is_file():
        raise CompileError(f"{argv[0]} exited 0 but wrote no {QPC_DIR}/{QPC_PROGRAM}")


def resolve_compiler(run: bool | None) -> str | None:
    """The compiler to run, or None when not running; ``run=True`` requires one."""
    if run is False:
        return None
    compiler = find_compiler()
    if compiler is None and run:
        raise CompileError(
            f"no QAIC compiler found: set {COMPILER_ENV} or put {COMPILER_NAME} on PATH "
            f"(the command is in {SCRIPT_FILE})"
        )
    return compiler


def _write_mdp(package_dir: Path, options: QaicOptions) -> str | None:
    """The partition config in the package: the user's file copied, else the template for > 1 device."""
    if options.mdp_config is not None:
        source = Path(options.mdp_config)
        try:
            config = json.loads(source.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"--mdp-config {source}: cannot read it as JSON ({exc}); give a partition config file"
            ) from None
        if not isinstance(config, dict) or "partitions" not in config:
            raise ConfigError(f"--mdp-config {source}: no 'partitions' list; give a qaic-compile partition config")
        write_text_atomic(package_dir / MDP_FILE, source.read_text(encoding="utf-8"))
        return MDP_FILE
    if options.num_devices > 1:
        mdp = mdp_partition_config(options.num_devices, options.num_cores)
        write_text_atomic(package_dir / MDP_FILE, json.dumps(mdp, indent=2) + "\n")
        return MDP_FILE
    return None


def _notes(hw: HwDetection, precisions: Precisions, graph_dtype: GraphDtype) -> list[str]:
    """What the compile decided without being told, for the user to read."""
    notes = [] if hw.source == "given" else [hw.message]
    if hw.version == "ai200" and graph_dtype == "float32" and precisions.kv_precision == "float16":
        notes.append(
            "ai200: the float32 network is compiled as QEfficient compiles a float32 model "
            "(-convert-to-fp16, float16 KV); bfloat16 needs a bfloat16 export"
        )
    if not precisions.pass_custom_io:
        notes.append(f"network and KV are both bfloat16: {CUSTOM_IO_FILE} is written but not passed (as QEfficient)")
    return notes


def prepare_qaic(
    package_dir: Path,
    *,
    onnx_path: str | os.PathLike[str],
    specializations_path: str | os.PathLike[str],
    num_layers: int,
    options: QaicOptions,
    graph_dtype: GraphDtype = "float32",
    feature_outputs: tuple[str, ...] = (),
    run: bool | None = None,
    latent: bool = False,
) -> QaicResult:
    """Write the vendor files and ``compile_qaic.sh`` into ``package_dir``; compile if possible.

    The hardware version is ``options.aic_hw_version`` or detected (:func:`detect_hw_version`); the
    precisions follow QEfficient for a ``graph_dtype`` network on that card. ``run=None`` compiles
    when a compiler is found, ``run=True`` requires one, ``run=False`` only writes files.
    ``feature_outputs`` (``hidden_states`` for a draft head) join the custom IO list in the float
    precision a head's inputs take (:attr:`QaicOptions.io_float_dtype`), so they pass unconverted.
    Returns the manifest entry of the backend (paths relative to the package).
    """
    package_dir = Path(package_dir)
    onnx_rel = _relative(onnx_path, package_dir)
    specs_rel = _relative(specializations_path, package_dir)
    hw = detect_hw_version(options.aic_hw_version)
    precisions = resolve_precisions(
        hw_version=hw.version,
        graph_dtype=graph_dtype,
        mxint8_kv_cache=options.mxint8_kv_cache,
        convert_to_fp16=options.convert_to_fp16,
        kv_dtype=options.kv_dtype,
    )
    features = "".join(f" - IOName: {name}\n   Precision: {options.io_float_dtype}\n\n" for name in feature_outputs)
    custom_io = custom_io_yaml(num_layers, kv_dtype=precisions.kv_precision, latent=latent) + features
    write_text_atomic(package_dir / CUSTOM_IO_FILE, custom_io)
    mdp_rel = _write_mdp(package_dir, options)

    compiler = resolve_compiler(run)
    argv = qaic_compile_argv(
        compiler=compiler or DEFAULT_COMPILER,
        onnx_path=onnx_rel,
        specializations_path=specs_rel,
        custom_io_path=CUSTOM_IO_FILE,
        qpc_dir=QPC_DIR,
        options=options,
        hw_version=hw.version,
        precisions=precisions,
        mdp_path=mdp_rel,
    )
    write_executable(package_dir / SCRIPT_FILE, compile_script(argv))
    if compiler is not None:
        run_compiler(argv, cwd=package_dir)
    return QaicResult(
        compiler=compiler,
        ran=compiler is not None,
        argv=argv,
        script=SCRIPT_FILE,
        qpc_dir=QPC_DIR,
        custom_io=CUSTOM_IO_FILE,
        mdp_partition_config=mdp_rel,
        onnx=onnx_rel,
        specializations=specs_rel,
        options=options,
        aic_hw_version=hw.version,
        kv_precision=precisions.kv_precision,
        notes=_notes(hw, precisions, graph_dtype),
    )
