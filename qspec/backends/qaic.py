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
from typing import Any, Literal

from pydantic import Field, model_validator

from qspec import contract
from qspec.common import FrozenModel, write_text_atomic
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

KvDtype = Literal["float16", "float32"]


class QaicOptions(FrozenModel):
    """Options of the vendor compiler, named after its flags (``num_cores`` → ``-aic-num-cores``).

    ``kv_dtype`` is the precision of the KV cache inputs and outputs on device. It defaults to
    ``float16`` when the network is converted to fp16 and to ``float32`` otherwise; ``float16``
    KV with ``convert_to_fp16=False`` is refused (it would mix precisions at every layer's KV).
    """

    aic_hw_version: str = "ai100"
    num_cores: int = Field(default=16, ge=1)
    num_devices: int = Field(default=1, ge=1)
    mxfp6_matmul: bool = False
    mos: int | None = Field(default=None, ge=1)
    aic_enable_depth_first: bool = False
    convert_to_fp16: bool = True
    kv_dtype: KvDtype = "float16"

    @model_validator(mode="before")
    @classmethod
    def _default_kv_dtype(cls, data: Any) -> Any:
        if isinstance(data, dict) and "kv_dtype" not in data:
            fp16 = data.get("convert_to_fp16", True)
            data = {**data, "kv_dtype": "float16" if fp16 else "float32"}
        return data

    @model_validator(mode="after")
    def _check_kv_dtype(self) -> QaicOptions:
        if self.kv_dtype == "float16" and not self.convert_to_fp16:
            raise ValueError(
                "kv_dtype float16 needs convert_to_fp16=True (got convert_to_fp16=False); "
                "use kv_dtype float32 or enable convert_to_fp16"
            )
        return self


class QaicResult(FrozenModel):
    """What :func:`prepare_qaic` did, as the manifest records it (paths relative to the package)."""

    compiler: str | None  # the compiler that ran; None when none was found (or run=False)
    ran: bool
    argv: list[str]  # the command line, also in ``script``
    script: str
    qpc_dir: str
    custom_io: str
    mdp_partition_config: str | None
    onnx: str
    specializations: str
    options: QaicOptions


# --------------------------------------------------------------------------------------------
# Vendor files
# --------------------------------------------------------------------------------------------


def custom_io_yaml(num_layers: int, *, kv_dtype: str = "float16") -> str:
    """QEfficient's custom IO list: every KV input, then every ``_RetainedState`` output.

    For one layer::

         - IOName: past_key.0
           Precision: float16

         - IOName: past_value.0
           Precision: float16

         - IOName: past_key.0_RetainedState
           Precision: float16

         - IOName: past_value.0_RetainedState
           Precision: float16

    """
    inputs = contract.kv_names(num_layers)
    names = inputs + [contract.retained(name) for name in inputs]
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


def qaic_compile_argv(
    *,
    compiler: str,
    onnx_path: str | os.PathLike[str],
    specializations_path: str | os.PathLike[str],
    custom_io_path: str | os.PathLike[str],
    qpc_dir: str | os.PathLike[str],
    options: QaicOptions,
    mdp_path: str | os.PathLike[str] | None = None,
) -> list[str]:
    """The compiler's command line, in the order QEfficient's ``_compile`` builds it.

    ``mdp_path`` is required when ``num_devices > 1``. ``-compile-only`` is not passed: current
    ``qaic-compile`` binaries reject it (QEfficient removed it in 1.22); only the deprecated
    ``qaic-exec``, which also runs networks, needs it to stop after compiling.
    """
    if options.num_devices > 1 and mdp_path is None:
        raise ConfigError(
            f"num_devices {options.num_devices} needs an MDP partition config; pass mdp_path (prepare_qaic writes one)"
        )
    argv = [
        compiler,
        "-aic-hw",
        f"-aic-hw-version={options.aic_hw_version}",
        f"-m={os.fspath(onnx_path)}",
        "-retained-state",
    ]
    if options.convert_to_fp16:
        argv.append("-convert-to-fp16")
    if options.mxfp6_matmul:
        argv.append("-mxfp6-matmul")
    argv.append(f"-aic-num-cores={options.num_cores}")
    if options.mos is not None:
        argv.append(f"-mos={options.mos}")
    if options.aic_enable_depth_first:
        argv.append("-aic-enable-depth-first")
    if mdp_path is not None:
        argv.append(f"-mdp-load-partition-config={os.fspath(mdp_path)}")
    argv += [
        f"-network-specialization-config={os.fspath(specializations_path)}",
        f"-custom-IO-list-file={os.fspath(custom_io_path)}",
        f"-aic-binary-dir={os.fspath(qpc_dir)}",
    ]
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


def _write_executable(path: Path, text: str) -> None:
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


def _resolve_compiler(run: bool | None) -> str | None:
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


def prepare_qaic(
    package_dir: Path,
    *,
    onnx_path: str | os.PathLike[str],
    specializations_path: str | os.PathLike[str],
    num_layers: int,
    options: QaicOptions,
    run: bool | None = None,
) -> QaicResult:
    """Write the vendor files and ``compile_qaic.sh`` into ``package_dir``; compile if possible.

    ``run=None`` compiles when a compiler is found, ``run=True`` requires one, ``run=False``
    only writes files. Returns the manifest entry of the backend (paths relative to the package).
    """
    package_dir = Path(package_dir)
    onnx_rel = _relative(onnx_path, package_dir)
    specs_rel = _relative(specializations_path, package_dir)
    custom_io = custom_io_yaml(num_layers, kv_dtype=options.kv_dtype)
    write_text_atomic(package_dir / CUSTOM_IO_FILE, custom_io)
    mdp_rel = None
    if options.num_devices > 1:
        mdp = mdp_partition_config(options.num_devices, options.num_cores)
        write_text_atomic(package_dir / MDP_FILE, json.dumps(mdp, indent=2) + "\n")
        mdp_rel = MDP_FILE

    compiler = _resolve_compiler(run)
    argv = qaic_compile_argv(
        compiler=compiler or DEFAULT_COMPILER,
        onnx_path=onnx_rel,
        specializations_path=specs_rel,
        custom_io_path=CUSTOM_IO_FILE,
        qpc_dir=QPC_DIR,
        options=options,
        mdp_path=mdp_rel,
    )
    _write_executable(package_dir / SCRIPT_FILE, compile_script(argv))
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
    )
