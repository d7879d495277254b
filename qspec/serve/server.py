"""Load a package and serve it: the options of ``qspec serve`` and the uvicorn run.

uvicorn owns SIGINT/SIGTERM: it stops accepting connections, lets in-flight requests finish for up to
``shutdown_timeout`` seconds and cancels the rest (their engine requests are aborted); then the app's
lifespan stops the engine thread.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from pydantic import Field

from qspec.common import FrozenModel


class ServeOptions(FrozenModel):
    """How ``qspec serve`` runs; ``method_options`` go to the proposer (``prompt_lookup_max``, ``draft_package``...)."""

    package: Path
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    method: str = "pld"
    method_options: dict[str, Any] = Field(default_factory=dict)
    dispatch: str = "auto"
    max_batch_size: int | None = Field(default=None, ge=1)
    num_threads: int | None = Field(default=None, ge=1)
    spinning: bool = True
    served_model_name: str | None = None
    max_waiting: int = Field(default=64, ge=0)
    shutdown_timeout: float = Field(default=10.0, ge=0)
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.package).name


def build(options: ServeOptions):
    """(app, worker): the engine loaded, its thread not yet started (the app's lifespan starts it)."""
    from qspec.runtime.engine import Engine
    from qspec.serve.app import create_app
    from qspec.serve.metrics import ServeMetrics
    from qspec.serve.worker import EngineWorker

    engine = Engine(
        options.package,
        method=options.method,
        max_batch_size=options.max_batch_size,
        dispatch=options.dispatch,
        num_threads=options.num_threads,
        spinning=options.spinning,
        **options.method_options,
    )
    metrics = ServeMetrics(options.model_name, engine.ks if options.method != "none" else [0])
    worker = EngineWorker(engine, metrics, max_waiting=options.max_waiting)
    return create_app(engine, worker, served_model_name=options.model_name), worker


def make_server(app, options: ServeOptions):
    import uvicorn

    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=options.shutdown_timeout,
        access_log=options.log_level == "debug",
    )
    return uvicorn.Server(config)


def serve(options: ServeOptions) -> None:
    """Load the package and serve until SIGINT/SIGTERM."""
    app, _ = build(options)
    make_server(app, options).run()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (for tests and the load run)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
