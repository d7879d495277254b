"""The compile backends' records, beside the package layer: what ``manifest.json`` and ``head/head.json`` keep
of a backend (:class:`QaicResult`) and the options it was given (:class:`QaicOptions`).

They live here, not in :mod:`qspec.backends.qaic`, so the package layer (:mod:`qspec.package`,
:mod:`qspec.head_manifest`) reads them without importing a backend: layers import downwards only
(``tests/test_architecture.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from qspec.common import FrozenModel

HwVersion = Literal["ai100", "ai200"]
GraphDtype = Literal["float32", "bfloat16"]  # the exported network's float type
KvDtype = Literal["float16", "float32", "bfloat16"]

# Flags qspec sets itself: given through --qaic-option they would clash, so the option says which to use.
OWN_FLAGS = {
    "-m": None,
    "-aic-hw": None,
    "-aic-hw-version": "--aic-hw-version",
    "-aic-num-cores": "--num-cores",
    "-retained-state": None,
    "-convert-to-fp16": None,
    "-mxfp6-matmul": "--mxfp6-matmul",
    "-mos": "--mos",
    "-aic-enable-depth-first": "--aic-enable-depth-first",
    "-mdp-load-partition-config": "--mdp-config",
    "-network-specialization-config": None,
    "-custom-IO-list-file": None,
    "-aic-binary-dir": None,
    "-compile-only": None,
}


def _check_compiler_option(option: str) -> str:
    """One ``-FLAG`` or ``-FLAG=VALUE`` passed verbatim; flags qspec sets itself are refused."""
    flag = option.partition("=")[0]
    if not flag.startswith("-") or flag.startswith("--") or len(flag) < 2:
        raise ValueError(f"compiler option {option!r} is not -FLAG or -FLAG=VALUE (one dash, as qaic-compile takes it)")
    if flag in OWN_FLAGS:
        use = OWN_FLAGS[flag]
        hint = f"use {use}" if use else "qspec sets it"
        raise ValueError(f"compiler option {option!r}: {hint}")
    return option


class QaicOptions(FrozenModel):
    """Options of the vendor compiler, named after its flags (``num_cores`` → ``-aic-num-cores``).

    ``aic_hw_version`` None: detected with ``qaic-util`` at compile time (ai100 without it).
    ``convert_to_fp16`` / ``kv_dtype`` None: QEfficient's choice for the network on that card
    (:mod:`qspec.backends.qaic_target`); ``mxint8_kv_cache`` makes the KV ``mxint8`` in the custom IO
    list. ``compiler_options``: more ``-FLAG[=VALUE]`` passed verbatim (``-ols=2``,
    ``-allow-mxint8-mdp-io``). ``mdp_config``: the user's multi-device partition file, copied into
    the package; it wins over the template ``num_devices > 1`` writes, as in QEfficient.
    """

    aic_hw_version: HwVersion | None = None
    num_cores: int = Field(default=16, ge=1)
    num_devices: int = Field(default=1, ge=1)
    mxfp6_matmul: bool = False
    mxint8_kv_cache: bool = False
    mos: int | None = Field(default=None, ge=1)
    aic_enable_depth_first: bool = False
    convert_to_fp16: bool | None = None
    kv_dtype: KvDtype | None = None
    compiler_options: tuple[str, ...] = ()
    mdp_config: str | None = None

    @property
    def io_float_dtype(self) -> KvDtype:
        """The float precision of a float32 network's KV (mxint8 aside) and feature IO on device:
        ``kv_dtype`` when given, else float16 with fp16 conversion (the default), float32 without."""
        return self.kv_dtype or ("float32" if self.convert_to_fp16 is False else "float16")

    @field_validator("compiler_options")
    @classmethod
    def _check_compiler_options(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_check_compiler_option(option) for option in value)

    @model_validator(mode="after")
    def _check_kv(self) -> QaicOptions:
        if self.mxint8_kv_cache and self.kv_dtype is not None:
            raise ValueError(f"give mxint8_kv_cache or kv_dtype {self.kv_dtype}, not both")
        if self.kv_dtype == "float16" and self.convert_to_fp16 is False:
            raise ValueError(
                "kv_dtype float16 needs convert_to_fp16=True (got convert_to_fp16=False); "
                "use kv_dtype float32 or enable convert_to_fp16"
            )
        if self.kv_dtype == "bfloat16" and self.aic_hw_version == "ai100":
            raise ValueError("kv_dtype bfloat16 needs aic_hw_version ai200 (ai100 has no bfloat16)")
        return self


class QaicResult(FrozenModel):
    """What :func:`prepare_qaic` did, as the manifest records it (paths relative to the package)."""

    compiler: str | None  # the compiler that ran; None when none was found (or run=False)
    ran: bool
    argv: list[str]  # the command line, also in ``script``
    script: str
    qpc_dir: str
    custom_io: str  # written always; passed unless network and KV are both bfloat16
    mdp_partition_config: str | None
    onnx: str
    specializations: str
    options: QaicOptions
    aic_hw_version: HwVersion | None = None  # what the command targets (None: a package of an older qspec)
    kv_precision: str | None = None  # the custom IO precision of the KV cache (likewise)
    notes: list[str] = Field(default_factory=list)  # what was decided for the user, printed by ``qspec compile``
