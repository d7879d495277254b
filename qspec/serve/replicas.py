"""``qspec serve PACKAGE --replicas N``: N engine replicas behind one OpenAI endpoint, on Ray Serve.

Each replica is the one-process server's FastAPI app (same routes, errors, streaming, /metrics), built
inside a Ray Serve replica (``serve.ingress`` with ``__serve_build_asgi_app__``: the app, its engine
and its engine thread are made on the replica, and Ray Serve runs the app's lifespan). Ray Serve's
proxy listens on ``--host:--port`` and spreads requests over the replicas: a request with an
``x-session-id`` header to the replica that key hashes to (its conversation's prefixes are there:
:mod:`qspec.serve.ray_router`), others to the shorter queue of two. Every response names its replica
in the ``x-qspec-replica`` header; ``/metrics`` answers with every replica's counters summed
(:mod:`qspec.serve.ray_metrics`).

A local Ray instance is started unless ``--ray-address`` (or ``RAY_ADDRESS``) names a cluster to join;
SIGINT/SIGTERM delete the application and stop what this process started (Serve and the local
instance; on a joined cluster only the application). Ray is imported here only: ``--replicas 1`` is
:func:`qspec.serve.server.serve` and never imports it.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

from pydantic import Field, model_validator

from qspec.common import FrozenModel
from qspec.errors import ConfigError

APP_NAME = "qspec"
REPLICA_HEADER = "x-qspec-replica"
ROUTER = "qspec.serve.ray_router:ConversationRouter"  # a conversation's turns go to one replica


class ReplicaOptions(FrozenModel):
    """How many replicas, their autoscaling bounds, and which Ray cluster (None: a local instance)."""

    replicas: int = Field(default=1, ge=1)
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=1)
    ray_address: str | None = None
    cpus_per_replica: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> ReplicaOptions:
        low = self.min_replicas if self.min_replicas is not None else self.replicas
        high = self.max_replicas if self.max_replicas is not None else self.replicas
        if not low <= self.replicas <= high:
            raise ValueError(
                f"--replicas {self.replicas} must lie within --min-replicas {low} and --max-replicas {high}"
            )
        return self

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def deployment_options(self) -> dict:
        """Ray Serve's deployment options: a fixed count, or autoscaling between the bounds from ``replicas``."""
        actor = {
            "ray_actor_options": {"num_cpus": self.cpus_per_replica},
            "request_router_config": {"request_router_class": ROUTER},
        }
        if not self.autoscaling:
            return {"num_replicas": self.replicas, **actor}
        bounds = {
            "min_replicas": self.min_replicas if self.min_replicas is not None else self.replicas,
            "max_replicas": self.max_replicas if self.max_replicas is not None else self.replicas,
            "initial_replicas": self.replicas,
        }
        return {"autoscaling_config": bounds, **actor}


class EngineReplica:
    """One replica: the one-process server's app, built on the replica from ``ServeOptions`` as JSON."""

    def __init__(self, options_json: str):
        self.options_json = options_json

    def __serve_build_asgi_app__(self):
        from fastapi import Request, Response
        from prometheus_client import CONTENT_TYPE_LATEST
        from ray import serve

        from qspec.serve.ray_metrics import ReplicaMetrics
        from qspec.serve.server import ServeOptions, build

        app, self.worker = build(ServeOptions.model_validate_json(self.options_json))
        replica = serve.get_replica_context().replica_id.unique_id
        self.metrics = ReplicaMetrics(replica, self.worker.metrics.render)

        @app.middleware("http")
        async def name_the_replica(request: Request, call_next):
            if request.url.path == "/metrics" and request.method == "GET":  # every replica's counters, summed
                response = Response(await self.metrics.summed(), media_type=CONTENT_TYPE_LATEST)
            else:
                response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            return response

        return app


def engine_deployment(options, replica_options: ReplicaOptions):
    """The bound Ray Serve application: ``replica_options``' replicas of ``options``' server."""
    _, serve = _import_ray(replica_options.replicas)
    deployment = serve.deployment(serve.ingress()(EngineReplica), name="engine", **replica_options.deployment_options())
    return deployment.bind(options.model_dump_json())


def build_app(args: dict):
    """Ray Serve's application builder (``import_path: qspec.serve.replicas:build_app``, as a KubeRay
    RayService's ``serveConfigV2`` names it): ``args`` are ``qspec serve``'s options by their field names
    (``package``, ``method``, ``served_model_name``, ...) plus ``replicas`` / ``min_replicas`` / ``max_replicas``.

    >>> build_app({"package": "/models/smollm2", "replicas": 2})  # doctest: +SKIP
    """
    from qspec.serve.server import ServeOptions

    scaling = {key: args[key] for key in ReplicaOptions.model_fields if key in args}
    rest = {key: value for key, value in args.items() if key not in scaling}
    return engine_deployment(ServeOptions.create(**rest), ReplicaOptions.create(**scaling))


def _import_ray(replicas: int):
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError(
            f"--replicas {replicas} runs on Ray Serve, which is not installed: pip install 'qspec[ray]'"
        ) from None
    return ray, serve


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A one-line error now for an address nobody listens on (``ray.init`` would wait minutes for it).

    ``auto`` (the cluster this machine belongs to) is left to Ray; ``host:port`` and ``ray://host:port``
    must accept a TCP connection.
    """
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address!r} is not host:port (or ray://host:port, or auto)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"cannot reach the Ray cluster at {address!r} ({reason}); check --ray-address / RAY_ADDRESS, "
            "or leave it out to start a local Ray instance"
        ) from None


def _connect(ray, address: str | None) -> bool:
    """Join ``address`` or start a local instance; True when this process started it."""
    if address:
        check_reachable(address)
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
            return False
        # A local instance stays on loopback: its processes talk to each other, not to the network.
        ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
        return True
    except Exception as exc:  # ConnectionError, ValueError, RuntimeError, depending on what is wrong
        where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"cannot reach {where} ({first}); check --ray-address / RAY_ADDRESS, or start one with `ray start --head`"
        ) from None


def serve_replicas(options, replica_options: ReplicaOptions, *, on_ready=None) -> None:
    """Deploy ``options.package`` as ``replica_options.replicas`` replicas on Ray Serve and serve until
    SIGINT/SIGTERM; ``on_ready(url)`` once the endpoint answers."""
    from qspec.serve.server import listen

    ray, serve = _import_ray(replica_options.replicas)
    listen(options).close()  # a taken port is one line now, not a proxy failing later
    address = replica_options.ray_address or os.environ.get("RAY_ADDRESS") or None
    started_ray = _connect(ray, address)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        deployment = serve.deployment(
            serve.ingress()(EngineReplica), name="engine", **replica_options.deployment_options()
        )
        serve.run(deployment.bind(options.model_dump_json()), name=APP_NAME, route_prefix="/", blocking=False)
        if on_ready is not None:
            on_ready(f"http://{options.host}:{options.port}")
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            serve.delete(APP_NAME)
            _delete_board(ray)
            if started_ray:
                serve.shutdown()
        finally:
            ray.shutdown()


def _delete_board(ray) -> None:
    """The replicas' metrics board (:mod:`qspec.serve.ray_metrics`) goes with the application."""
    from qspec.serve.ray_metrics import BOARD_NAME, NAMESPACE

    try:
        ray.kill(ray.get_actor(BOARD_NAME, namespace=NAMESPACE))
    except ValueError:  # no replica made one
        pass
