"""The runtime: speculative decoding on a compiled package (no torch needed), on ONNX Runtime or a QAIC device.

>>> from qspec.runtime import Engine, EngineConfig, SamplingParams
>>> engine = Engine("packages/SmolLM2-135M-Instruct.Q4_1-k0_4", EngineConfig.create(method="pld"))
>>> [out] = engine.generate("Rename x to y: x = 1; print(x)", SamplingParams(max_new_tokens=64), chat=True)
>>> out.text, out.metrics.mean_accepted_tokens, engine.last_metrics.output_tokens_per_s
"""

from qspec.runtime.config import EngineConfig
from qspec.runtime.dispatch import pick_k
from qspec.runtime.engine import Engine
from qspec.runtime.metrics import EngineMetrics, RequestMetrics
from qspec.runtime.request import RequestDelta, RequestOutput
from qspec.runtime.sampling import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "RequestDelta",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "pick_k",
]
