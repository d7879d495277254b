"""Read a checkpoint tensor by tensor, so an export never holds the whole model.

A model folder holds ``model.safetensors`` or shards named by ``model.safetensors.index.json``
(:class:`Checkpoint`); a ``.gguf`` file is read by :class:`GGUFCheckpoint`, which dequantizes each
tensor as transformers' GGUF loader would. The exporter traces a skeleton whose weights mostly
live on the meta device and hands the graph writer one :class:`StreamedWeights`: every initializer
is a lazy tensor that reads its checkpoint tensor, converts it to fp32 in the layout the graph
stores (``[in, out]`` for MatMul weights) and is dropped once written. Peak memory is then the
largest tensor, not the model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

SAFE_FILE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
Progress = Callable[[str], None]
# At most one weight-progress line per this many seconds (an 8B model has ~290 tensors).
PROGRESS_SECONDS = 2.0


class Checkpoint:
    """The tensors of a safetensors checkpoint, by name: ``names``, ``read(name)``."""

    description = "the safetensors checkpoint"

    def __init__(self, files: dict[str, Path]):
        self._files = files  # tensor name -> shard file

    @classmethod
    def find(cls, folder: Path) -> Checkpoint | None:
        """The checkpoint of a model folder, or None when it has no safetensors weights."""
        index = folder / SAFE_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls({name: folder / file for name, file in weight_map.items()})
        single = folder / SAFE_FILE
        if single.is_file():
            from safetensors import safe_open

            with safe_open(single, framework="pt") as handle:
                return cls(dict.fromkeys(handle.keys(), single))
        return None

    @property
    def names(self) -> set[str]:
        return set(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def read(self, name: str):
        """Tensor ``name`` as stored, in memory of its own.

        The shard is opened for this one read: an open shard stays mapped, and every page read
        through it would count in this process's resident memory until the export ends.
        """
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as handle:
            return handle.get_tensor(name)


class _Stored(NamedTuple):
    """Where one tensor of a GGUF file lies, and how transformers' reader shapes its raw data."""

    gguf_name: str
    ggml_type: int
    offset: int  # from the start of the file
    dtype: str  # of the raw data: uint8 blocks for quantized types, the value type otherwise
    shape: tuple[int, ...]  # of the raw data


class GGUFCheckpoint:
    """The tensors of a GGUF file under the model's state-dict names: ``names``, ``read(name)``.

    ``read`` gives the tensor transformers' GGUF loader (``load_gguf_checkpoint``) puts in the model,
    by running its own steps on that one tensor: the name map (``get_gguf_hf_weights_map``),
    ``gguf.dequantize``, the architecture's tensor processor (Llama's q/k permutation undone), fp32.
    """

    description = "the GGUF file"

    def __init__(self, path: Path, tensors: dict[str, _Stored], processor):
        self._path = path
        self._tensors = tensors  # model name -> its raw data in the file
        self._processor = processor

    @classmethod
    def open(cls, path: Path, model) -> GGUFCheckpoint | None:
        """The tensors of ``path`` for ``model`` (a skeleton of the file's config), or None when
        transformers converts this architecture's tensors other than one at a time.

        Only the file's header is read here; ``gguf.GGUFReader`` maps the file without reading tensors.
        """
        import gguf
        import transformers.modeling_gguf_pytorch_utils as hf_gguf

        reader = gguf.GGUFReader(path)
        architecture = hf_gguf.read_field(reader, "general.architecture")[0]
        processor_class = hf_gguf.TENSOR_PROCESSORS.get(architecture, hf_gguf.TensorProcessor)
        if processor_class not in _per_tensor_processors(hf_gguf) or _loaded_another_way(architecture):
            return None
        processor = processor_class(config=hf_gguf.load_gguf_checkpoint(path)["config"])
        to_model = hf_gguf.get_gguf_hf_weights_map(model, processor)
        tensors = {
            to_model[t.name]: _Stored(t.name, int(t.tensor_type), int(t.data_offset), t.data.dtype.str, t.data.shape)
            for t in reader.tensors
            if t.name in to_model
        }
        return cls(path, tensors, processor)

    @property
    def names(self) -> set[str]:
        return set(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def read(self, name: str):
        """Tensor ``name`` dequantized to fp32, read from the file on its own (the file is not kept mapped)."""
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType, dequantize

        stored = self._tensors[name]
        count = int(np.prod(stored.shape))
        raw = np.fromfile(self._path, dtype=stored.dtype, count=count, offset=stored.offset).reshape(stored.shape)
        weights = dequantize(raw, GGMLQuantizationType(stored.ggml_type))
        weights = self._processor.process(weights=weights, name=stored.gguf_name).weights
        return torch.from_numpy(np.ascontiguousarray(weights)).to(torch.float32)


def _per_tensor_processors(hf_gguf) -> set[type]:
    """transformers' tensor processors whose result depends on one tensor alone (others merge experts)."""
    names = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor", "NemotronTensorProcessor")
    return {getattr(hf_gguf, name) for name in names if hasattr(hf_gguf, name)}


def _loaded_another_way(architecture: str) -> bool:
    """Whether transformers loads this GGUF architecture through its packed-weights path, not the one read here."""
    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:
        return False
    return is_gguf_arch_supported(architecture)


class StreamedWeights:
    """Initializer data read from a :class:`Checkpoint` or :class:`GGUFCheckpoint` when the graph writer asks for it.

    ``transposed``: names of weights the graph stores ``[in, out]`` (the checkpoint holds ``[out, in]``).
    """

    def __init__(
        self, checkpoint: Checkpoint | GGUFCheckpoint, transposed: Iterable[str], *, progress: Progress | None = None
    ):
        self.checkpoint = checkpoint
        self.transposed = set(transposed)
        self.say = progress or (lambda message: None)
        self.total_tensors = 0
        self.total_bytes = 0
        self.written_tensors = 0
        self.written_bytes = 0
        self._begin: float | None = None
        self._last = 0.0

    def __contains__(self, name: str) -> bool:
        return name in self.checkpoint

    def lazy(self, name: str, like):
        """An ``onnx_ir`` lazy fp32 tensor shaped like ``like`` that reads ``name`` when written."""
        import onnx_ir as ir

        shape = tuple(like.shape)
        self.total_tensors += 1
        self.total_bytes += 4 * like.numel()
        return ir.LazyTensor(lambda: self._load(name, shape), dtype=ir.DataType.FLOAT, shape=ir.Shape(shape), name=name)

    def _load(self, name: str, shape: tuple[int, ...]):
        import onnx_ir as ir
        import torch

        if self._begin is None:
            self._begin = time.perf_counter()
        stored = self.checkpoint.read(name)
        source = stored.t() if name in self.transposed else stored
        if tuple(source.shape) != shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(stored.shape)}; the model expects {shape}")
        out = torch.empty(shape, dtype=torch.float32)  # one fp32 copy, converted and laid out in one pass
        out.copy_(source)
        del stored, source
        self.written_tensors += 1
        self.written_bytes += out.nbytes
        self._report()
        return ir.tensor_adapters.TorchTensor(out, name=name)

    def _report(self) -> None:
        now = time.perf_counter()
        done = self.written_tensors == self.total_tensors
        if not done and now - self._last < PROGRESS_SECONDS:
            return
        self._last = now
        elapsed = now - self._begin
        rate = self.written_bytes / elapsed if elapsed > 0 else 0.0
        left = (self.total_bytes - self.written_bytes) / rate if rate > 0 else 0.0
        self.say(
            f"writing weights: {self.written_tensors}/{self.total_tensors} tensors, "
            f"{self.written_bytes / 2**30:.1f}/{self.total_bytes / 2**30:.1f} GiB, "
            f"{rate / 2**20:.0f} MiB/s, ETA {left:.0f} s"
        )
