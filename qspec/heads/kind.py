"""What one kind of draft head is to the compiler: the seam every kind (EAGLE-1, EAGLE-3, Medusa, turbo, MTP)
implements once, in a module of its own, listed in :data:`qspec.heads.kinds.KINDS`.

A kind answers, for a checkpoint folder: is it mine (:meth:`HeadKind.detect`), the torch module
(:meth:`~HeadKind.load`), what the target graph must hand the head (:meth:`~HeadKind.taps`), the head graph
(:meth:`~HeadKind.trace`), its specializations and their file, its custom IO, its ONNX Runtime rewrite
(:meth:`~HeadKind.fuse`) and the manifest fields it adds. It names the runtime proposer that runs it
(``method``, a key of :data:`qspec.runtime.heads.HEAD_PROPOSERS`), so the CLI's method names come from that
table alone. :func:`qspec.heads.package.compile_head` calls nothing else.

Example, a new kind ``foo`` drafting like EAGLE::

    class FooKind(EagleKind):
        layout, expects = "foo", "config.json with architectures [FooForCausalLM]"
        def detect(self, folder, config): return "FooForCausalLM" in (config or {}).get("architectures", [])
        def load(self, folder, target): return load_foo(folder, target)

and one line in ``KINDS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from qspec.specializations import Specialization, SpecializationConfig


@dataclass(frozen=True)
class TracedHead:
    """A head graph (``onnx_ir`` model, float32 weights in memory) and the names of its inputs and outputs."""

    model: Any
    input_names: list[str]
    output_names: list[str]


@dataclass(frozen=True)
class TargetTaps:
    """What the target graph computes for a head instead of its final-norm hidden state: the residual stream
    entering each of ``layer_ids`` (``output_hidden_states[i]``, 0 the embeddings), concatenated in that order
    and mapped by ``fc`` ([H, len(layer_ids) * H], no bias) to the one ``[B, S, H]`` feature the head reads."""

    layer_ids: tuple[int, ...]
    fc: Any  # torch.Tensor [hidden, len(layer_ids) * hidden]

    def key(self) -> str:
        """A digest of the taps and the weights, for the target's export key."""
        import hashlib

        digest = hashlib.sha256(repr(self.layer_ids).encode())
        digest.update(self.fc.detach().float().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]


class HeadKind(ABC):
    """One checkpoint layout of a draft head and how it becomes a package's head (module doc)."""

    layout: ClassVar[str]  # HeadManifest.layout
    method: ClassVar[str]  # HeadManifest.method: the runtime proposer that runs it
    expects: ClassVar[str]  # what detect looks for, in the error naming every kind

    @abstractmethod
    def detect(self, folder: Path, config: dict | None) -> bool:
        """``folder`` (its ``config.json`` as a dict, None without one) holds a head of this kind."""

    @abstractmethod
    def load(self, folder: Path, target) -> Any:
        """The torch module, tables the checkpoint lacks taken from ``target`` (``get_input_embeddings()``,
        ``get_output_embeddings()``; may be None)."""

    @abstractmethod
    def hidden_size(self, head) -> int:
        """Width of the features the head reads (must equal the target's)."""

    def tap_request(self, folder: Path, config: dict | None) -> tuple[int, ...] | str:
        """The taps the target graph must export for this head, known before the head is loaded: ``()`` none
        (it reads the final-norm hidden states), layer ids, or ``"vllm"`` (vLLM's default ids for the target)."""
        return ()

    def taps(self, head, num_layers: int) -> TargetTaps | None:
        """What the target graph must compute for this head (None: its final-norm hidden states)."""
        return None

    def prepare(self, head) -> None:
        """Last changes before tracing (a Medusa head shares equal LM heads)."""

    @abstractmethod
    def trace(self, head, config: SpecializationConfig) -> TracedHead:
        """The head graph of the qspec contract."""

    def programs(self, head) -> int:
        """How many head graphs the kind compiles, each a program of its own (``head/``, ``head/layer{i}/``):
        one per MTP layer, else one."""
        return 1

    def trace_program(self, head, config: SpecializationConfig, program: int) -> TracedHead:
        """The graph of program ``program`` (``0 <= program < programs(head)``)."""
        return self.trace(head, config)

    @abstractmethod
    def specializations(self, head, config: SpecializationConfig) -> list[Specialization]:
        """The head's shapes for the target's specialization config."""

    @abstractmethod
    def write_specializations(self, specs: list[Specialization], path: Path, fmt: str) -> None:
        """The vendor's specializations file of the head graph."""

    @abstractmethod
    def custom_io(self, kv_dtype: str) -> str:
        """The head's ``custom_io.yaml``: the tensors qaic keeps in ``kv_dtype``."""

    def fuse(self, model, head, config: SpecializationConfig, specs: list[Specialization]) -> dict | None:
        """Rewrite ``model`` (a copy) for ONNX Runtime in place; the manifest fields that describe it, or None
        when the runtime loads the vendor graph as it is (unless quantized)."""
        return None

    @abstractmethod
    def manifest_fields(self, head, config: SpecializationConfig) -> dict:
        """The manifest fields of this kind (``num_heads``, ``num_layers``, the KV cache's shape)."""
