"""The peers the bench measures beside qspec (ONNX Runtime GenAI, llama.cpp); the bench's one entry is
:func:`plan_peers` (which runners can run here, and why the others cannot).

- :mod:`.runners`: each peer behind a :class:`~qspec.bench.runners.Runner`, and the plan;
- :mod:`.models`: the peers' own model files, built once and cached;
- :mod:`.workers`: the child processes that load and run them.
"""

from qspec.bench.peers.models import PeerUnavailable
from qspec.bench.peers.runners import LLAMA_CPP, ORT_GENAI, PeerPlan, plan_peers

__all__ = ["LLAMA_CPP", "ORT_GENAI", "PeerPlan", "PeerUnavailable", "plan_peers"]
