"""The embedded backend: ONNX Runtime on the CPU, one static-shape session per specialization.

Facts that shape this module (the numbers: ``docs/measurements.md``):

- Each session pre-packs its own copy of every MatMul weight. Sharing the initializers
  (``add_initializer``) does not share those copies in the Python API, and turning pre-packing off
  makes every call slower; so the compile-time check loads one static session at
  a time, and the runtime serves every specialization from one session (``qspec.runtime.model``).
- Per-session thread pools spin while idle and steal the cores from the session that runs, so a
  process with several sessions lets at most one of them spin. (ORT's global thread pool would
  avoid this, but once set it makes every other session in the process fail to load.)
- Every dimension of a session is fixed (``add_free_dimension_override_by_name``) from its
  specialization: the static shapes the vendor compiler would build.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from qspec import contract
from qspec.backends import ort_plan
from qspec.errors import CompileError
from qspec.specializations import Specialization

PROVIDERS = ["CPUExecutionProvider"]


def default_threads() -> int:
    """Threads per session: the cores this process may run on."""
    import os

    return len(os.sched_getaffinity(0))


def session_options(fixed: Mapping[str, int], *, spinning: bool, num_threads: int | None = None) -> ort.SessionOptions:
    """Options of one session: its own thread pool, the dimensions in ``fixed`` set to their sizes."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads or default_threads()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    for key, value in fixed.items():
        options.add_free_dimension_override_by_name(key, value)
    return options


def create_session(
    onnx_path: Path,
    spec: Specialization,
    *,
    spinning: bool = False,
    num_threads: int | None = None,
    prepack: bool = True,
) -> ort.InferenceSession:
    """A fully static session of ``onnx_path`` for ``spec``; a failure names the specialization.

    ``prepack=False`` skips ORT's repacking of the MatMul weights: a session that is only loaded
    and run once (the compile-time check) does not pay for a layout it never uses.
    """
    options = session_options(spec.symbols(), spinning=spinning, num_threads=num_threads)
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    try:
        return ort.InferenceSession(str(onnx_path), options, providers=PROVIDERS)
    except Exception as exc:  # ORT raises plain RuntimeErrors / Fail
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CompileError(f"ONNX Runtime could not load specialization {spec.describe()}: {first}") from exc


def static_dims(session: ort.InferenceSession) -> dict[str, list]:
    """``{io name: dims}`` as the session sees them: all integers when every dimension is fixed."""
    return {value.name: list(value.shape) for value in session.get_inputs() + session.get_outputs()}


def check_static(session: ort.InferenceSession, spec: Specialization) -> None:
    """Fail when a dimension of the session is still symbolic after fixing ``spec``'s keys.

    ONNX Runtime fixes the keys of the inputs; an output whose size an op's shape inference does
    not derive (GroupQueryAttention's present KV) keeps the key's name, which the bound buffer fixes.
    """
    keys = set(spec.symbols())
    for name, dims in static_dims(session).items():
        if not all(isinstance(d, int) or d in keys for d in dims):
            raise CompileError(
                f"specialization {spec.describe()} leaves {name} with dims {dims}: the graph has a "
                "symbolic dimension that is not a specialization key"
            )


def zero_feeds(session: ort.InferenceSession, spec: Specialization) -> dict[str, np.ndarray]:
    """Inputs of the specialization's shapes: token 0, positions 0.., rows on their own slots."""
    feeds = {}
    for value in session.get_inputs():
        dtype = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}.get(value.type, np.float32)
        feeds[value.name] = np.zeros(value.shape, dtype=dtype)
    feeds[contract.POSITION_IDS] = np.tile(np.arange(spec.seq_len, dtype=np.int64), (spec.batch_size, 1))
    if contract.BATCH_INDEX in feeds:
        feeds[contract.BATCH_INDEX] = np.arange(spec.batch_size, dtype=np.int64)[:, None]
    return feeds | ort_plan.feeds(feeds[contract.POSITION_IDS], spec.num_logits_to_keep or 1, feeds)


def smoke_run(session: ort.InferenceSession, spec: Specialization, vocab_size: int) -> None:
    """One call on zeros: the logits must have the specialization's shape and be finite."""
    outputs = session.run([contract.LOGITS], zero_feeds(session, spec))
    keep = spec.num_logits_to_keep or 1
    want = (spec.batch_size, keep if spec.seq_len > 1 or keep > 1 else 1, vocab_size)
    logits = outputs[0]
    if logits.shape != want or not np.isfinite(logits).all():
        raise CompileError(
            f"specialization {spec.describe()} gave logits of shape {logits.shape} "
            f"(finite: {bool(np.isfinite(logits).all())}); expected {want}"
        )
