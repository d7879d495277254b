"""The QAIC target: which card the compile is for, and the precisions QEfficient picks for it.

QEfficient's rules (``QEfficient/utils/constants.py::get_default_aic_hw_version``,
``QEfficient/transformers/models/modeling_auto.py``: ``CUSTOM_IO_DTYPE_MAP``, ``_resolve_torch_dtype``,
``QEFFAutoModelForCausalLM.compile``), restated:

- the hardware version is ``ai200`` when ``qaic-util -q`` reports a ``FW IMAGE_VARIANT`` containing
  ``AIC200``, else ``ai100`` (also when the tool is missing);
- a float32 network is compiled with ``-convert-to-fp16`` and float16 KV (the compiler does not run
  fp32); a bfloat16 network (AI200 only: ai100 loads bfloat16 models as float32) keeps bfloat16 and
  bfloat16 KV, and then the custom IO list is written but not passed;
- ``mxint8_kv_cache`` makes the KV inputs and retained-state outputs ``mxint8`` in the custom IO list;
  there is no compiler flag for it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from qspec.backend_records import GraphDtype, HwVersion, KvDtype
from qspec.common import FrozenModel
from qspec.errors import ConfigError

DEFAULT_HW_VERSION: HwVersion = "ai100"
UTIL_NAME = "qaic-util"
SDK_UTIL = "/opt/qti-aic/tools/qaic-util"  # where the platform SDK installs it
UTIL_TIMEOUT_S = 10
MXINT8 = "mxint8"
_VARIANT = re.compile(r"FW IMAGE_VARIANT\s*:\s*(\S+)")


class HwDetection(FrozenModel):
    """The hardware version to compile for and how it was found (printed by ``qspec compile``)."""

    version: HwVersion
    source: str  # "qaic-util", "given" or "default"
    message: str


def _find_util() -> str | None:
    on_path = shutil.which(UTIL_NAME)
    if on_path:
        return on_path
    return SDK_UTIL if os.path.isfile(SDK_UTIL) and os.access(SDK_UTIL, os.X_OK) else None


def hw_version_from_util_output(text: str) -> HwVersion:
    """``ai200`` when the first ``FW IMAGE_VARIANT`` line names AIC200, else ``ai100``."""
    match = _VARIANT.search(text)
    return "ai200" if match and "AIC200" in match.group(1).upper() else "ai100"


def detect_hw_version(given: HwVersion | None = None) -> HwDetection:
    """``given`` when set; else what ``qaic-util -q`` reports; else ai100, saying so."""
    if given is not None:
        return HwDetection(version=given, source="given", message=f"-aic-hw-version={given} (given)")
    util = _find_util()
    if util is None:
        return HwDetection(
            version=DEFAULT_HW_VERSION,
            source="default",
            message=f"-aic-hw-version={DEFAULT_HW_VERSION}: no {UTIL_NAME} found to detect the card; "
            "pass --aic-hw-version ai200 to compile for an AI200 card",
        )
    try:
        result = subprocess.run([util, "-q"], capture_output=True, text=True, timeout=UTIL_TIMEOUT_S, check=False)
        output = result.stdout
    except (OSError, subprocess.SubprocessError):
        output = ""
    version = hw_version_from_util_output(output)
    return HwDetection(version=version, source=UTIL_NAME, message=f"-aic-hw-version={version} (from {util} -q)")


class Precisions(FrozenModel):
    """What the compile does with float types: conversion flag, KV precision, whether custom IO is passed."""

    convert_to_fp16: bool
    kv_precision: str  # the custom IO Precision of every KV input and retained-state output
    pass_custom_io: bool  # False when network and KV are both bfloat16 (QEfficient writes the file, skips the flag)


def qefficient_precisions(*, hw_version: HwVersion, graph_dtype: GraphDtype, mxint8_kv_cache: bool) -> Precisions:
    """QEfficient's choice for a network of ``graph_dtype`` on ``hw_version``.

    >>> qefficient_precisions(hw_version="ai100", graph_dtype="float32", mxint8_kv_cache=True).kv_precision
    'mxint8'
    """
    if graph_dtype == "bfloat16" and hw_version != "ai200":
        raise ConfigError(
            f"a bfloat16 network needs -aic-hw-version=ai200 (got {hw_version}); ai100 has no bfloat16: "
            "export in float32 or compile for ai200"
        )
    kv = "bfloat16" if graph_dtype == "bfloat16" else "float16"
    return Precisions(
        convert_to_fp16=kv == "float16",
        kv_precision=MXINT8 if mxint8_kv_cache else kv,
        pass_custom_io=not (graph_dtype == "bfloat16" and kv == "bfloat16" and not mxint8_kv_cache),
    )


def resolve_precisions(
    *,
    hw_version: HwVersion,
    graph_dtype: GraphDtype,
    mxint8_kv_cache: bool,
    convert_to_fp16: bool | None = None,
    kv_dtype: KvDtype | None = None,
) -> Precisions:
    """QEfficient's precisions, with the user's ``convert_to_fp16`` / ``kv_dtype`` overrides applied.

    ``convert_to_fp16=False`` alone keeps a float32 network and float32 KV (a qspec extension:
    QEfficient never compiles fp32). Contradictions raise ConfigError naming both values.
    """
    base = qefficient_precisions(hw_version=hw_version, graph_dtype=graph_dtype, mxint8_kv_cache=mxint8_kv_cache)
    convert = base.convert_to_fp16 if convert_to_fp16 is None else convert_to_fp16
    if mxint8_kv_cache:
        kv = MXINT8
    elif kv_dtype is not None:
        kv = kv_dtype
    elif convert_to_fp16 is False and graph_dtype == "float32":
        kv = "float32"
    else:
        kv = base.kv_precision
    if kv == "float16" and not convert and graph_dtype == "float32":
        raise ConfigError(
            "kv_dtype float16 needs convert_to_fp16=True (got convert_to_fp16=False); "
            "use kv_dtype float32 or enable convert_to_fp16"
        )
    if kv == "bfloat16" and graph_dtype != "bfloat16":
        raise ConfigError(
            f"kv_dtype bfloat16 needs a bfloat16 network on ai200 (this one is {graph_dtype}, which QEfficient "
            "compiles with float16 KV on either card); use the default float16 or --mxint8-kv-cache"
        )
    return Precisions(convert_to_fp16=convert, kv_precision=kv, pass_custom_io=base.pass_custom_io or kv != "bfloat16")
