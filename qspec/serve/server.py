"""Load a package and serve it: the options of ``qspec serve`` and the uvicorn run.

uvicorn owns SIGINT/SIGTERM: it stops accepting connections, lets in-flight requests finish for up to
``shutdown_timeout`` seconds and cancels the rest (their engine requests are aborted); then the app's
lifespan stops the engine thread. A shutdown asked for by a signal is a normal end: ``serve`` returns
(exit code 0) whether the SIGINT came from a terminal's Ctrl-C or from ``kill -INT``.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from qspec.common import FrozenModel
from qspec.errors import ConfigError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


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
    prefix_cache: bool = True  # reuse an idle slot's KV for a prompt that starts with its tokens
    served_model_name: str | None = None
    max_waiting: int = Field(default=64, ge=0)
    shutdown_timeout: float = Field(default=10.0, ge=0)
    log_level: str = "info"
    api_key: str | None = None  # when set, /v1/* requests must send `Authorization: Bearer <api_key>`

    @field_validator("served_model_name", "api_key")
    @classmethod
    def _not_empty(cls, value: str | None, info) -> str | None:
        if value is not None and not value.strip():
            flag = "--" + info.field_name.replace("_", "-")
            raise ValueError(f"{flag} is empty; give a value or leave the option out")
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        if value.lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level {value!r}: use one of {', '.join(LOG_LEVELS)}")
        return value.lower()

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.package).name


def build(options: ServeOptions):
    """(app, worker): the engine loaded, its thread not yet started (the app's lifespan starts it)."""
    from qspec.runtime.config import EngineConfig
    from qspec.runtime.engine import Engine
    from qspec.serve.app import create_app
    from qspec.serve.metrics import ServeMetrics
    from qspec.serve.worker import EngineWorker

    config = EngineConfig.create(
        method=options.method,
        max_batch_size=options.max_batch_size,
        dispatch=options.dispatch,
        num_threads=options.num_threads,
        spinning=options.spinning,
        prefix_cache=options.prefix_cache,
        **options.method_options,
    )
    engine = Engine(options.package, config)
    metrics = ServeMetrics(options.model_name, engine.ks if options.method != "none" else [0])
    worker = EngineWorker(engine, metrics, max_waiting=options.max_waiting)
    return create_app(engine, worker, served_model_name=options.model_name, api_key=options.api_key), worker


def make_server(app, options: ServeOptions):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises the signal it shut down on once it is done, so the exit code depended on how
        SIGINT was handled before (130 under a terminal, 0 where the shell ignores it for a background job);
        a graceful shutdown is not an error: the signal is not raised again."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=options.shutdown_timeout,
        access_log=options.log_level == "debug",
    )
    return Server(config)


def listen(options: ServeOptions) -> socket.socket:
    """A socket bound to ``options.host:port``, before the model loads: a taken port or a bad host is a
    one-line ConfigError, not a uvicorn traceback after the load."""
    try:
        infos = socket.getaddrinfo(options.host, options.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"--host {options.host!r} is not an address ({exc.strerror}); try 127.0.0.1 or 0.0.0.0"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {options.host}:{options.port} ({exc.strerror}); pick another --port or --host"
        ) from None
    return sock


def serve(options: ServeOptions) -> None:
    """Load the package and serve until SIGINT/SIGTERM."""
    sock = listen(options)
    app, _ = build(options)
    make_server(app, options).run(sockets=[sock])


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (for tests and the load run)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
