"""Read a safetensors checkpoint tensor by tensor, so an export never holds the whole model.

A model folder holds ``model.safetensors`` or shards named by ``model.safetensors.index.json``. The
exporter traces a skeleton whose weights mostly live on the meta device and hands the graph writer
one :class:`StreamedWeights`: every initializer is a lazy tensor that reads its checkpoint tensor,
converts it to fp32 in the layout the graph stores (``[in, out]`` for MatMul weights) and is
dropped once written. Peak memory is then the largest tensor, not the model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

SAFE_FILE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
Progress = Callable[[str], None]
# At most one weight-progress line per this many seconds (an 8B model has ~290 tensors).
PROGRESS_SECONDS = 2.0


class Checkpoint:
    """The tensors of a safetensors checkpoint, by name: ``names``, ``shape(name)``, ``read(name)``."""

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


class StreamedWeights:
    """Initializer data read from a :class:`Checkpoint` when the graph writer asks for it.

    ``transposed``: names of weights the graph stores ``[in, out]`` (the checkpoint holds ``[out, in]``).
    """

    def __init__(self, checkpoint: Checkpoint, transposed: Iterable[str], *, progress: Progress | None = None):
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
