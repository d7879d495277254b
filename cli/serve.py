"""``qspec serve`` and ``qspec serve-load``: thin Typer layers over :mod:`qspec.serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from qspec_cli.common import (
    DispatchOption,
    DraftPackageOption,
    DraftThresholdOption,
    MethodOption,
    TreeWidthOption,
    cli_errors,
    console,
    escape,
)


def _require_serve_extra() -> None:
    from qspec.errors import ConfigError

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"qspec serve needs the serve extra ({exc.name} is missing): pip install 'qspec[serve]'"
        ) from None


def method_options(
    method: str,
    *,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    draft_package: Optional[Path],
    draft_confidence_threshold: Optional[float] = None,
    tree_width: Optional[int] = None,
) -> dict[str, Any]:
    from qspec.errors import ConfigError
    from qspec.runtime.proposers import HEAD_METHODS, METHOD_ALIASES

    options: dict[str, Any] = {}
    method = METHOD_ALIASES.get(method, method)
    if draft_confidence_threshold is not None and method in (*HEAD_METHODS, "draft"):
        options["draft_confidence_threshold"] = draft_confidence_threshold
    if tree_width is not None and tree_width > 1:
        if method not in HEAD_METHODS:
            raise ConfigError(
                f"--tree-width {tree_width} is for a draft head's method (eagle, eagle+pld), not {method}"
            )
        options["tree_width"] = tree_width
    if method == "pld" or method.endswith("+pld"):
        options |= {"prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max}
    if method == "draft":
        if draft_package is None:
            raise ConfigError(
                "--method draft needs --draft-package DIR (compile one with `qspec compile --num-layers N`)"
            )
        options["draft_package"] = draft_package
    return options


def serve(
    package: Annotated[Path, typer.Argument(metavar="PACKAGE", help="A package directory written by `qspec compile`.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    method: MethodOption = "pld",
    prompt_lookup_min: Annotated[int, typer.Option(help="pld: smallest n-gram to match.")] = 1,
    prompt_lookup_max: Annotated[int, typer.Option(help="pld: largest n-gram to match.")] = 3,
    draft_package: DraftPackageOption = None,
    draft_confidence_threshold: DraftThresholdOption = None,
    tree_width: TreeWidthOption = None,
    dispatch: DispatchOption = "auto",
    max_batch_size: Annotated[
        Optional[int], typer.Option(help="Requests in the running batch (default: all KV slots).")
    ] = None,
    max_waiting: Annotated[int, typer.Option(help="Requests that may wait for a slot; past it: 429.")] = 64,
    num_threads: Annotated[Optional[int], typer.Option(help="ONNX Runtime threads (default: all cores).")] = None,
    spinning: Annotated[
        bool, typer.Option(help="ONNX Runtime threads spin between calls (off: kinder to a shared machine).")
    ] = True,
    served_model_name: Annotated[
        Optional[str], typer.Option(help="The `model` clients send (default: the package folder's name).")
    ] = None,
    prefix_cache: Annotated[
        bool,
        typer.Option(
            help="Reuse a finished request's KV for a prompt that starts with its tokens (a conversation's next turn)."
        ),
    ] = True,
    api_key: Annotated[
        Optional[str],
        typer.Option(
            help="Clients must send it as 'Authorization: Bearer KEY' (default: no key).", envvar="QSPEC_API_KEY"
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float, typer.Option(help="Seconds in-flight requests get to finish on SIGINT/SIGTERM.")
    ] = 10.0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level (debug logs every request).")] = "info",
    replicas: Annotated[
        int, typer.Option(help="Engine replicas behind the endpoint; more than 1 runs on Ray Serve (extra `ray`).")
    ] = 1,
    min_replicas: Annotated[
        Optional[int], typer.Option(help="Ray Serve autoscaling: fewest replicas (default: --replicas).")
    ] = None,
    max_replicas: Annotated[
        Optional[int], typer.Option(help="Ray Serve autoscaling: most replicas (default: --replicas).")
    ] = None,
    ray_address: Annotated[
        Optional[str],
        typer.Option(
            help="Ray cluster to join, e.g. ray://head:10001 (default: start a local one).", envvar="RAY_ADDRESS"
        ),
    ] = None,
) -> None:
    """Serve PACKAGE with an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics)."""
    with cli_errors():
        _require_serve_extra()
        from qspec_cli.common import status

        from qspec.serve.server import ServeOptions, build, listen, make_server

        options = ServeOptions.create(
            package=package,
            host=host,
            port=port,
            method=method,
            method_options=method_options(
                method,
                prompt_lookup_min=prompt_lookup_min,
                prompt_lookup_max=prompt_lookup_max,
                draft_package=draft_package,
                draft_confidence_threshold=draft_confidence_threshold,
                tree_width=tree_width,
            ),
            dispatch=dispatch,
            max_batch_size=max_batch_size,
            served_model_name=served_model_name,
            max_waiting=max_waiting,
            num_threads=num_threads,
            spinning=spinning,
            prefix_cache=prefix_cache,
            shutdown_timeout=shutdown_timeout,
            log_level=log_level,
            api_key=api_key,
        )
        if replicas > 1 or min_replicas is not None or max_replicas is not None:
            from qspec.serve.replicas import ReplicaOptions, serve_replicas

            replica_options = ReplicaOptions.create(
                replicas=replicas,
                min_replicas=min_replicas,
                max_replicas=max_replicas,
                ray_address=ray_address,
                cpus_per_replica=num_threads or 1,
            )
            name = escape(options.model_name)
            ready = f"serving [bold]{name}[/] ({replicas} replicas on Ray Serve) on {{url}}/v1"
            serve_replicas(options, replica_options, on_ready=lambda url: console.print(ready.format(url=url)))
            return
        sock = listen(options)  # before the load: a taken port is one line, not a traceback after it
        with status("loading the package"):
            app, worker = build(options)
        console.print(
            f"serving [bold]{escape(options.model_name)}[/] ({worker.engine.method}, {worker.engine.num_slots} slots) "
            f"on http://{escape(host)}:{port}/v1"
        )
        make_server(app, options).run(sockets=[sock])


def serve_load(
    package: Annotated[
        Path,
        typer.Argument(
            metavar="PACKAGE", help="A package with several KV slots (`qspec compile ... --full-batch-size 4`)."
        ),
    ],
    methods: Annotated[str, typer.Option(help="Methods to serve, one server each, e.g. pld,none.")] = "pld,none",
    requests: Annotated[int, typer.Option(help="Requests per method (MT-bench first turns).")] = 64,
    concurrency: Annotated[int, typer.Option(help="Clients in flight at most.")] = 32,
    rate: Annotated[float, typer.Option(help="Poisson arrivals per second.")] = 4.0,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of every request.")] = 128,
    time_limit: Annotated[float, typer.Option(help="Seconds one method's run may take at most.")] = 600.0,
    verify: Annotated[bool, typer.Option(help="Compare every response with the engine's greedy output.")] = True,
    prefix_cache: Annotated[
        bool, typer.Option(help="The servers reuse prefixes across requests (off: qspec serve --no-prefix-cache).")
    ] = True,
    spinning: Annotated[
        bool, typer.Option(help="ONNX Runtime threads spin between calls (off: kinder to a shared machine).")
    ] = True,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the reports as JSON.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the reports as JSON.")] = False,
) -> None:
    """Load-test `qspec serve` on loopback: concurrent streaming clients, Poisson arrivals, bounded."""
    with cli_errors():
        import json

        _require_serve_extra()
        from qspec_cli.common import status

        from qspec.errors import QSpecError
        from qspec.serve.load import LoadOptions, run_load

        options = LoadOptions.create(
            requests=requests,
            concurrency=concurrency,
            rate=rate,
            max_tokens=max_tokens,
            time_limit_s=time_limit,
            spinning=spinning,
            prefix_cache=prefix_cache,
        )
        with status("load run") as say:
            reports = run_load(
                package, [m.strip() for m in methods.split(",") if m.strip()], options, verify=verify, progress=say
            )
        dumped = [r.model_dump() for r in reports]
        if output is not None:
            output.write_text(json.dumps(dumped, indent=2))
        if as_json:
            print(json.dumps(dumped, indent=2))
        else:
            print(
                f"{'method':8} {'ok':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>15} "
                f"{'TPOT p50':>8} {'accept':>7} {'mean len':>8} {'prefix hit':>10}"
            )
            for r in reports:
                rate_text = f"{r.acceptance_rate:.0%}" if r.acceptance_rate is not None else "-"
                length = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "-"
                hits = f"{r.prefix_cache_hit_rate:.0%}" if r.prefix_cache_hit_rate is not None else "-"
                print(
                    f"{r.method:8} {r.completed:>2}/{r.requests:<2} {r.requests_per_s:7.3f} "
                    f"{r.output_tokens_per_s:9.1f} {r.ttft_ms_p50:8.0f}/{r.ttft_ms_p99:<8.0f} "
                    f"{r.itl_ms_p50:7.1f}/{r.itl_ms_p99:<7.1f} {r.tpot_ms_p50:8.1f} {rate_text:>7} {length:>8} "
                    f"{hits:>10}"
                )
        bad = [(r.method, r.failed, len(r.mismatched)) for r in reports if r.failed or r.mismatched]
        if bad:
            raise QSpecError(
                "; ".join(f"{m}: {f} requests lost, {g} differ from the engine's greedy output" for m, f, g in bad)
            )
        if verify:
            console.print("every response equals the engine's greedy output for its prompt")
