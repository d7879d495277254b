"""``qspec serve``: an OpenAI-compatible HTTP server on the speculative engine (needs ``qspec[serve]``).

Modules: :mod:`~qspec.serve.protocol` (OpenAI request/response models), :mod:`~qspec.serve.app`
(routes), :mod:`~qspec.serve.worker` (the engine thread), :mod:`~qspec.serve.metrics` (Prometheus),
:mod:`~qspec.serve.errors` (status codes), :mod:`~qspec.serve.server` (options, uvicorn),
:mod:`~qspec.serve.load` (a bounded load run).
"""
