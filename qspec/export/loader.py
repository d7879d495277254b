"""Load a Hugging Face causal LM and its tokenizer from a local folder, a ``.gguf`` file or a hub id."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from qspec.errors import ModelLoadError

# Families whose target part is another family's model (the tensors it does not have, MTP layers, are left out).
CONFIG_ALIASES = {"mimo": "qwen2"}
# Files of a model folder that decide what gets exported (weights, config, tokenizer).
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt", ".jinja", ".gguf")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``folder`` plus an optional ``gguf_file`` inside it, or a hub id."""

    ref: str  # what the user typed
    folder: Path | None
    gguf_file: str | None = None

    @property
    def is_local(self) -> bool:
        return self.folder is not None


def resolve_source(model: str | os.PathLike) -> ModelSource:
    """Classify ``model`` as a ``.gguf`` file, a local folder, or (otherwise) a hub id."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file '{model}' does not exist")
        with open(path, "rb") as handle:  # a fake or truncated file fails here, named, before any hashing
            if handle.read(4) != b"GGUF":
                raise ModelLoadError(f"'{model}' is not a GGUF file (it does not start with the bytes GGUF)")
        return ModelSource(str(model), path.resolve().parent, path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"'{model}' is a folder without config.json; give a Hugging Face model folder")
        return ModelSource(str(model), path.resolve())
    if path.exists() or str(model).startswith((".", "/", "~")) or str(model).count("/") > 1:
        raise ModelLoadError(f"'{model}' is neither a model folder, a .gguf file nor a hub id")
    return ModelSource(str(model), None)


def check_family(source: ModelSource) -> None:
    """An unsupported family (a BERT or GPT-2 folder) fails from its ``config.json`` alone, before the
    seconds of hashing and loading its weights; a GGUF's or a hub id's family is checked when it loads."""
    import json
    from types import SimpleNamespace

    from qspec.export.wrapper import adapter_for

    if not source.is_local or source.gguf_file:
        return
    try:
        values = json.loads((source.folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {source.folder / 'config.json'}: {_first_line(exc)}") from None
    if isinstance(values, dict):  # the family only: RoPE and the rest are read from the parsed config
        family = CONFIG_ALIASES.get(values.get("model_type"), values.get("model_type"))  # MiMo's target is a Qwen2
        adapter_for(SimpleNamespace(model_type=family, architectures=values.get("architectures")))


def source_digest(source: ModelSource) -> str:
    """SHA-256 over the bytes of every file that defines the model (hub ids hash their name)."""
    digest = hashlib.sha256()
    if not source.is_local:
        digest.update(f"hub:{source.ref}".encode())
        return digest.hexdigest()
    if source.gguf_file:
        files = [source.folder / source.gguf_file]
    else:
        files = sorted(p for p in source.folder.iterdir() if p.is_file() and p.suffix in _MODEL_FILE_SUFFIXES)
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def read_config(where, **kwargs):
    """The model's config; a family of :data:`CONFIG_ALIASES` is read as the family its target part is.
    Example: MiMo's ``config.json`` (``model_type: mimo``) gives a ``Qwen2Config``."""
    import json

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    file = Path(where) / "config.json"
    values = json.loads(file.read_text()) if not kwargs and file.is_file() else {}
    if values.get("model_type") in CONFIG_ALIASES:
        family = CONFIG_ALIASES[values.pop("model_type")]
        return CONFIG_MAPPING[family].from_dict(values)
    return AutoConfig.from_pretrained(where, **kwargs)


def load_model(source: ModelSource):
    """Load ``(model, tokenizer)`` in fp32, eval mode. Errors say what to fix; nothing is downloaded offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from qspec.export.wrapper import adapter_for

    hf_logging.set_verbosity_error()  # qspec shows its own progress; keep transformers' bars off
    hf_logging.disable_progress_bar()
    where = str(source.folder) if source.is_local else source.ref
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    with _gguf_read_once() if source.gguf_file else contextlib.nullcontext():
        try:
            config = read_config(where, **kwargs)
        except (OSError, ValueError):
            config = None  # reported below, by the model load, with the same wording
        if config is not None:
            adapter_for(config)  # an unsupported family fails before the weights are read
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
            given = {"config": config} if config is not None else {}
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **given, **kwargs)
        except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: weights that do not fit the config
            if not source.is_local:
                raise ModelLoadError(
                    f"could not load '{source.ref}' from the hub (offline or unknown id?); "
                    f"give a local model folder or a .gguf file instead ({_first_line(exc)})"
                ) from exc
            named = source.folder / source.gguf_file if source.gguf_file else where  # the file the user gave
            raise ModelLoadError(f"could not load model from '{named}': {_first_line(exc)}") from exc
    _drop_quantizer(model)
    return model.eval(), tokenizer


def load_skeleton(source: ModelSource):
    """``(model, tokenizer, checkpoint)`` with the model's parameters on the meta device, or None when the
    weights cannot be streamed (``.bin``, hub ids, other tensor names, a GGUF architecture transformers
    converts other than tensor by tensor).

    The weights are read later, tensor by tensor, by :class:`~qspec.export.checkpoint.StreamedWeights`;
    buffers computed from the config (RoPE frequencies) are real.
    """
    if not source.is_local:
        return None
    if source.gguf_file:
        return _gguf_skeleton(source)
    from qspec.export.checkpoint import Checkpoint

    checkpoint = Checkpoint.find(source.folder)
    if checkpoint is None:
        return None
    from transformers import GenerationConfig

    model = _meta_model(source)
    if not _parameter_names(model) <= checkpoint.names:
        return None  # renamed or converted tensors: transformers' own loader knows how
    tokenizer = _tokenizer(source)
    with contextlib.suppress(OSError, ValueError):  # the eos ids of generation_config.json, as from_pretrained
        model.generation_config = GenerationConfig.from_pretrained(source.folder)
    return model.eval(), tokenizer, checkpoint


def _gguf_skeleton(source: ModelSource):
    """:func:`load_skeleton` of a ``.gguf`` file: config and tokenizer from transformers' GGUF reading, the
    weights from a :class:`~qspec.export.checkpoint.GGUFCheckpoint`."""
    from qspec.export.checkpoint import GGUFCheckpoint

    with _gguf_read_once():
        model = _meta_model(source)
        checkpoint = GGUFCheckpoint.open(source.folder / source.gguf_file, model)
        if checkpoint is None or not _parameter_names(model) <= checkpoint.names:
            return None
        tokenizer = _tokenizer(source)
    return model.eval(), tokenizer, checkpoint


def _meta_model(source: ModelSource):
    """The model of ``source``'s config in fp32, its parameters on the meta device (tied as from_pretrained ties)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from qspec.export.wrapper import adapter_for

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        config = read_config(source.folder, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model from '{source.folder}': {_first_line(exc)}") from exc
    adapter_for(config)  # an unsupported family fails before anything else
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # from_pretrained ties them; on the meta device from_config does not
    return model


def _tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(source.folder, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load the tokenizer from '{source.folder}': {_first_line(exc)}") from exc


def _parameter_names(model) -> set[str]:
    return {name for name, _ in model.named_parameters()}


def materialize(model, layers) -> int:
    """Give storage to the parameters outside the decoder layers and to those of ``layers``; returns
    how many tensors got some.

    The storage is uninitialized (``torch.empty``: no page is touched until written): the tracer needs
    real tensors of the right shapes, never their values, and the graph's weights come from the
    checkpoint. The layers not listed stay on the meta device. Tied parameters stay tied.
    """
    import torch
    from torch import nn

    keep = set(layers)
    skip = {id(p) for i, layer in enumerate(model.model.layers) if i not in keep for p in layer.parameters()}
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in skip or not param.is_meta:
                continue
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
            setattr(module, name, made[id(param)])
    return len(made)


@contextlib.contextmanager
def _gguf_read_once():
    """Parse a GGUF file once per load, not four times.

    transformers reads the file for the config (twice), the tokenizer and the weights, and parsing
    its metadata (49k vocabulary strings, one numpy view each) dominates the load; it also rebuilds
    gguf's tensor-name table for every tensor. Those are pure functions of their arguments, so they
    are memoized for the duration of the load (metadata handed out as deep copies, callers mutate
    it), and its progress bar is off. Where the names this expects are missing, it does nothing.
    """
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    originals = (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint, hf_gguf.tqdm)
    if not all(callable(f) for f in originals):
        yield
        return
    reader, name_map, checkpoint, bar = originals
    readers: dict[tuple, object] = {}
    metadata: dict[str, dict] = {}

    def read(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    def load_checkpoint(path, return_tensors=False, *args, **kwargs):
        if return_tensors:
            return checkpoint(path, return_tensors, *args, **kwargs)
        if str(path) not in metadata:
            metadata[str(path)] = checkpoint(path, False, *args, **kwargs)
        return copy.deepcopy(metadata[str(path)])

    gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.lru_cache(maxsize=None)(name_map)
    hf_gguf.load_gguf_checkpoint = load_checkpoint
    hf_gguf.tqdm = functools.partial(bar, disable=True)  # its bar would break qspec's progress line
    added = _missing_config_keys(hf_gguf)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint, hf_gguf.tqdm = originals
        for family, key in added:
            hf_gguf.GGUF_TO_TRANSFORMERS_MAPPING["config"][family].pop(key, None)


# GGUF metadata keys transformers' GGUF config reading leaves out, per family: (GGUF key, config field).
# qwen3_moe: without it, moe_intermediate_size takes Qwen3MoeConfig's default, 768 (Qwen3-30B-A3B's, not
# Qwen3-235B-A22B's 1536 nor a tiny model's), and the experts' weights do not fit (transformers 5.24).
GGUF_CONFIG_GAPS = {"qwen3_moe": ("expert_feed_forward_length", "moe_intermediate_size")}


def _missing_config_keys(hf_gguf) -> list[tuple[str, str]]:
    """Add :data:`GGUF_CONFIG_GAPS` to transformers' GGUF config mapping where it lacks them; the (family, key)
    pairs added, for the caller to take out again."""
    mapping = getattr(hf_gguf, "GGUF_TO_TRANSFORMERS_MAPPING", {}).get("config", {})
    added = []
    for family, (key, field) in GGUF_CONFIG_GAPS.items():
        if family in mapping and key not in mapping[family]:
            mapping[family][key] = field
            added.append((family, key))
    return added


def _drop_quantizer(model) -> None:
    """A GGUF model is dequantized on load; forget the quantizer so it saves and traces as plain fp32."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
