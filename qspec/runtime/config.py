"""How an :class:`~qspec.runtime.engine.Engine` runs, as one frozen value: the speculative method and its knobs,
dispatch, the batch, where the package runs. ``qspec generate``, ``qspec serve``, the bench's workers and a head's
data generation all build it with :meth:`EngineConfig.create`; ``Engine(package, config)`` takes it.

>>> EngineConfig.create(method="pld", prompt_lookup_max=4).proposer_knobs()
{'prompt_lookup_max': 4}
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from qspec.common import FrozenModel
from qspec.runtime.session import SessionMode

DISPATCH_MODES = ("auto", "cover", "cost")


class EngineConfig(FrozenModel):
    """The engine's options (module doc); the proposer's knobs the CLI sets are typed fields, any other knob of
    :func:`~qspec.runtime.proposers.make_proposer` goes in ``proposer_options``."""

    method: str = "pld"  # none, pld (ngram), suffix, user, draft, or the package's head (eagle, medusa, mtp, +pld)
    num_speculative_tokens: tuple[int, ...] | str | None = None  # a subset of the compiled Ks (default: all)
    dispatch: str = "auto"  # cover, cost, or auto (qspec.runtime.dispatch.Dispatcher)
    max_batch_size: int | None = None  # sequences in flight (default: every KV slot of the package)
    backend: str = "ort"  # where the package runs (qspec.runtime.load.RUNTIME_BACKENDS)
    session_mode: SessionMode = "shared"
    spinning: bool = True
    num_threads: int | None = None
    prefix_cache: bool = False
    force_accept: int | None = None  # testing: accept min(n, force_accept) drafts (output is then not greedy's)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_package: Path | None = None
    draft_confidence_threshold: float | None = None
    tree_width: int | None = None  # a head's drafts at depth 1 (2: its runner-up beside the chain; default 1)
    proposer_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _trees_are_a_heads(self) -> EngineConfig:
        from qspec.runtime.proposers import HEAD_METHODS, METHOD_ALIASES

        if (self.tree_width or 1) > 1 and METHOD_ALIASES.get(self.method, self.method) not in HEAD_METHODS:
            raise ValueError(
                f"tree_width {self.tree_width} is for a draft head's method (eagle, eagle+pld); {self.method} drafts "
                "chains: drop it or use --method eagle"
            )
        return self

    @classmethod
    def of(cls, **knobs: Any) -> EngineConfig:
        """The config of ``Engine(package, **knobs)``: fields by name, any other knob to the proposer."""
        fields = {name: value for name, value in knobs.items() if name in cls.model_fields}
        rest = {name: value for name, value in knobs.items() if name not in cls.model_fields}
        ks = fields.get("num_speculative_tokens")
        if isinstance(ks, Sequence) and not isinstance(ks, str):
            fields["num_speculative_tokens"] = tuple(ks)
        fields["proposer_options"] = fields.get("proposer_options", {}) | rest
        return cls.create(**fields)

    def proposer_knobs(self) -> dict[str, Any]:
        """The knobs given for the proposer (None: its default), as :func:`make_proposer` takes them."""
        typed = ("prompt_lookup_min", "prompt_lookup_max", "draft_package", "draft_confidence_threshold", "tree_width")
        return {name: getattr(self, name) for name in typed if getattr(self, name) is not None} | self.proposer_options
