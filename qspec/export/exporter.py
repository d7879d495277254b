"""Export a Hugging Face causal LM to the qspec ONNX contract, cached by content hash.

``export_model(model, options)`` returns the folder of a finished export::

    <cache>/exports/<key>/model.onnx, model.onnx.data, tokenizer/, export.json

The key hashes the model's files, the export options and the versions of qspec, torch and
transformers. An export is built in a ``.tmp-*`` sibling and renamed into place only once
``export.json`` is written, so an interrupted export never leaves a folder that looks valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from qspec import __version__
from qspec.common import build_directory
from qspec.errors import ConfigError, QSpecError
from qspec.export.graph import OPSET, ExportOptions, check_graph
from qspec.export.loader import ModelSource, load_model, load_skeleton, materialize, resolve_source, source_digest
from qspec.export.mla import cache_dims, expanded_dims, is_latent
from qspec.export.moe import is_moe, moe_info, stack_experts
from qspec.export.wrapper import adapter_for, attention_info

if TYPE_CHECKING:
    from qspec.export.checkpoint import Checkpoint, GGUFCheckpoint
from qspec.package import ONNX_FILE, TOKENIZER_DIR, ModelInfo

EXPORT_META = "export.json"
# Bump when the exporter writes a different graph or meta for the same model and options: old exports are stale
# (6: ModelInfo.moe, the MoE blocks the runtime graph runs as ONNX Runtime's MoE operator; 7: DeepSeek-V3's
# compressed latent cache, compressed_kv.{i} / k_pe.{i}, ModelInfo.kv_layout; 8: DeepSeek-V3's ModelInfo.moe,
# routing "table").
EXPORT_FORMAT = 8

Progress = Callable[[str], None]


class ExportMeta(BaseModel):
    """Contents of ``export.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str
    digest: str
    key: str
    options: ExportOptions
    model: ModelInfo
    versions: dict[str, str]
    export_seconds: float
    phase_seconds: dict[str, float] = Field(default_factory=dict)  # load, trace, optimize, compose, save, check
    onnx_bytes: int
    data_bytes: int
    streamed: bool = False  # weights read tensor by tensor from the checkpoint (never the whole model)
    peak_rss_bytes: int | None = None  # of the export process


def cache_root() -> Path:
    """``$QSPEC_CACHE_DIR`` or ``~/.cache/qspec``."""
    return Path(os.environ.get("QSPEC_CACHE_DIR") or Path.home() / ".cache" / "qspec").expanduser()


def export_key(digest: str, options: ExportOptions) -> str:
    import torch
    import transformers

    versions = f"qspec={__version__};torch={torch.__version__};transformers={transformers.__version__}"
    # Without tree inputs the options read as before they existed: earlier exports stay in the cache.
    dumped = options.model_dump_json(exclude=None if options.tree_inputs else {"tree_inputs"})
    payload = f"{digest}|{dumped}|{versions}|opset={OPSET}|format={EXPORT_FORMAT}"
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def read_export(folder: Path) -> ExportMeta:
    return ExportMeta.model_validate_json((folder / EXPORT_META).read_text())


def export_model(
    model: str | os.PathLike,
    options: ExportOptions | None = None,
    *,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    digest: str | None = None,
) -> tuple[Path, ExportMeta]:
    """Export ``model`` (folder, ``.gguf`` or hub id) or reuse the cached export; returns (folder, meta).

    ``digest``: the model files' ``source_digest`` when the caller has already computed it.
    """
    options = options or ExportOptions()
    say = progress or (lambda message: None)
    source = resolve_source(model)
    require_export_extra(gguf=source.gguf_file is not None)
    if digest is None:
        say("hashing model files")
        digest = source_digest(source)
    key = export_key(digest, options)
    final = (cache_dir or cache_root()) / "exports" / key
    if (final / EXPORT_META).is_file():
        return final, read_export(final)
    meta = build_directory(final, lambda folder: _export_in_child(folder, source, digest, key, options, say))
    return final, meta


def _export_in_child(folder: Path, source: ModelSource, digest: str, key: str, options, say: Progress) -> ExportMeta:
    """Run :func:`_export_into` in a fresh process and return its metadata; its progress comes through a pipe.

    The compile process then never holds the model: torch.export and onnxscript's rewrite rules keep
    module-level references to the last traced graph and with it every weight (a 1B model's 5 GB
    stayed resident while the compile checked its ONNX Runtime sessions), and torch is not even
    imported here. Errors arrive as the child raised them (one-line ``QSpecError``s stay one line).
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_export_child, args=(sender, folder, source, digest, key, options), daemon=True)
    child.start()
    sender.close()
    done = False
    try:
        while True:
            try:
                kind, payload = receiver.recv()
            except EOFError:
                child.join()
                raise QSpecError(
                    f"the export process of {source.ref} ended without a result (exit code {child.exitcode}); "
                    "out of memory? run `qspec --debug compile ...` to see more"
                ) from None
            if kind == "progress":
                say(payload)
            elif kind == "error":
                raise payload
            else:
                done = True
                return payload
    finally:
        receiver.close()
        # After a result the child only tears torch down (1-2 s): let it, without waiting. Otherwise stop it.
        child.join(timeout=0 if done else 30)
        if child.is_alive() and not done:
            child.terminate()
            child.join()


def _export_child(sender, folder: Path, source: ModelSource, digest: str, key: str, options) -> None:
    """The export process: :func:`_export_into`, then its result (or its error) back to the parent."""
    import pickle

    try:
        meta = _export_into(folder, source, digest, key, options, lambda message: sender.send(("progress", message)))
        sender.send(("done", meta))
    except BaseException as exc:  # KeyboardInterrupt too: the parent cleans up and re-raises it
        try:
            pickle.dumps(exc)
        except Exception:
            exc = QSpecError(f"ONNX export failed: {type(exc).__name__}: {exc}")
        sender.send(("error", exc))
    finally:
        sender.close()


# What exporting imports beyond the runtime's dependencies: the `export` extra of the package.
EXPORT_MODULES = ("torch", "transformers", "onnxscript", "onnx_ir")


def require_export_extra(*, gguf: bool = False) -> None:
    """Fail with the install command when a module the exporter needs is missing."""
    needed = EXPORT_MODULES + (("gguf",) if gguf else ())
    missing = [name for name in needed if _missing(name)]
    if missing:
        raise QSpecError(
            f"exporting a model needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            "installed; install the export extra: pip install 'qspec[export]' (with torch==2.13.0 for the CPU build)"
        )


def _missing(name: str) -> bool:
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name] is None
    return importlib.util.find_spec(name) is None


def _export_into(folder: Path, source: ModelSource, digest: str, key: str, options, say: Progress) -> ExportMeta:
    import torch
    import transformers

    start = time.perf_counter()
    say(f"loading {source.ref}")
    skeleton = load_skeleton(source)
    if skeleton is not None and any(is_moe(layer.mlp) for layer in skeleton[0].model.layers):
        skeleton = None  # the exporter stacks the experts' weights anew (qspec.export.moe.stack_experts)
    if skeleton is not None:
        model, tokenizer, checkpoint = skeleton
        say(f"streaming the weights from {checkpoint.description} (the model is never held whole)")
    else:
        say("loading the whole model: its weights cannot be streamed from this checkpoint")
        (model, tokenizer), checkpoint = load_model(source), None
    adapter_for(model.config)  # unsupported families fail before the slow part
    if options.num_layers is not None:
        _truncate_layers(model, options.num_layers)
    info = _model_info(model, tokenizer, latent_cache=options.latent_cache)
    phases = {"load": round(time.perf_counter() - start, 2)}
    phases |= trace_to_onnx(model, folder / ONNX_FILE, options, info, say, checkpoint=checkpoint)
    say("checking the ONNX graph")
    begin = time.perf_counter()
    check_graph(folder / ONNX_FILE, info.num_layers, options, latent=info.kv_layout == "latent")
    say("saving the tokenizer")
    tokenizer.save_pretrained(folder / TOKENIZER_DIR)
    phases["check"] = round(time.perf_counter() - begin, 2)
    meta = ExportMeta(
        source=source.ref,
        digest=digest,
        key=key,
        options=options,
        model=info,
        versions={"qspec": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
        export_seconds=round(time.perf_counter() - start, 2),
        phase_seconds=phases,
        onnx_bytes=(folder / ONNX_FILE).stat().st_size,
        data_bytes=sum(p.stat().st_size for p in folder.glob(ONNX_FILE + ".data")),
        streamed=checkpoint is not None,
        peak_rss_bytes=_peak_rss(),
    )
    (folder / EXPORT_META).write_text(meta.model_dump_json(indent=2) + "\n")
    return meta


def _truncate_layers(model, num_layers: int) -> None:
    layers = model.model.layers
    if num_layers > len(layers):
        raise ConfigError(f"num_layers {num_layers} > the model's {len(layers)} layers; give at most {len(layers)}")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]


def _model_info(model, tokenizer, *, latent_cache: bool) -> ModelInfo:
    config = model.config
    attn = model.model.layers[0].self_attn
    eos = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), config.eos_token_id, tokenizer.eos_token_id):
        if value is not None:
            eos.update(value if isinstance(value, (list, tuple)) else [value])
    spec_fields = {k: v for k, v in config.to_dict().items() if k in ("num_speculative_tokens", "speculative_config")}
    # DeepSeek's MLA: compressed_kv.{i} (the latent) and k_pe.{i} (the rotated key), or each head's expanded K/V
    latent = is_latent(attn) and latent_cache
    expanded = is_latent(attn) and not latent_cache
    if is_latent(attn):
        key_width, value_width = cache_dims(attn) if latent else expanded_dims(attn)
    else:
        key_width = value_width = attn.head_dim
    return ModelInfo(
        model_type=config.model_type,
        num_layers=len(model.model.layers),
        num_kv_heads=1 if latent else config.num_attention_heads if expanded else config.num_key_value_heads,
        head_dim=key_width,
        value_head_dim=value_width if value_width != key_width else None,
        kv_layout="latent" if latent else "heads",
        vocab_size=config.vocab_size,
        eos_token_ids=sorted(eos),
        speculative_config=spec_fields,
        attention=attention_info(model),
        moe=moe_info(model, adapter_for(config).router),
    )


def trace_to_onnx(
    model,
    path: Path,
    options: ExportOptions,
    info: ModelInfo,
    say: Progress,
    *,
    checkpoint: Checkpoint | GGUFCheckpoint | None = None,
) -> dict[str, float]:
    """Trace the KV-explicit wrapper piece by piece and write the chained graph; returns phase seconds.

    Weights go to ``<path>.data``. See :mod:`qspec.export.trace` for why pieces. With ``checkpoint``
    the model is a skeleton (:func:`~qspec.export.loader.load_skeleton`): only the traced layers get
    storage, and every weight is read from the checkpoint as it is written.
    """
    import torch

    from qspec.export import trace
    from qspec.export.checkpoint import StreamedWeights
    from qspec.export.wrapper import InputMajorLinear, KVExplicitLM, hold_weights_input_major

    hold_weights_input_major(model)  # the graph stores MatMul weights [in, out]: nothing to transpose at load
    stack_experts(model)  # a MoE block's experts as two 2-D MatMul weights
    wrapper = KVExplicitLM(
        model,
        continuous_batching=options.continuous_batching,
        speculative=options.speculative,
        comp_ctx_lengths=options.comp_ctx_lengths,
        hidden_states=options.hidden_states,
        tree_inputs=options.tree_inputs,
        latent_cache=options.latent_cache,
    ).eval()
    streamed = None
    if checkpoint is not None:
        materialize(model, trace.representative_layers(wrapper))
        transposed = [f"{name}.weight" for name, mod in model.named_modules() if isinstance(mod, InputMajorLinear)]
        streamed = StreamedWeights(checkpoint, transposed, progress=say)
    times = trace.TraceTimes()
    with _quiet(), torch.no_grad():
        try:
            pieces = trace.trace_pieces(wrapper, info, options, times, say)
        except Exception as exc:  # the exporter's own errors are long; keep the first line
            raise QSpecError(f"ONNX export failed: {str(exc).strip().splitlines()[0]}") from exc
        say(f"chaining {info.num_layers} layers into one graph")
        begin = time.perf_counter()
        graph = trace.compose(wrapper, pieces, options, streamed=streamed)
        times.add("compose", time.perf_counter() - begin)
        say(f"writing the graph and weights ({'from the checkpoint, ' if streamed else ''}tensor by tensor)")
        begin = time.perf_counter()
        trace.save(graph, path)
        times.add("save", time.perf_counter() - begin)
    return times.phases


def _peak_rss() -> int | None:
    """Peak resident memory of this process (Linux/macOS ``ru_maxrss``), or None where unknown."""
    try:
        import resource
        import sys
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@contextlib.contextmanager
def _quiet():
    """Keep the exporter's prints and warnings off the user's terminal (rich progress says enough)."""
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        torch_logger.setLevel(level)
