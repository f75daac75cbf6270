"""``kvmosaic serve``: one engine process (``server.cli``), or with ``--replicas N`` the same
server as N Ray Serve replicas behind one front.

Both are built from one ``EngineArgs`` and one ``ServerArgs`` (the flags are theirs). With
replicas: joins ``--ray-address`` or starts a local Ray, deploys ``app.build_application`` and
serves on ``--host``/``--port``. On SIGTERM or SIGINT it drains as one server does: the front
stops admitting (503), running requests finish for up to ``--shutdown-timeout`` seconds, the rest
end with an explicit error; then Serve and (when this process started it) Ray shut down, leaving
no Ray process behind. A second signal cuts at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ..engine.arg_utils import EngineArgs
from ..server.args import ServerArgs

log = logging.getLogger("kvmosaic.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..server.cli import add_arguments as add_server_arguments

    add_server_arguments(p)


def run(ns: argparse.Namespace) -> int:
    if not ns.replicas:
        from ..server.cli import run as run_single

        return run_single(ns)
    try:
        engine_args, server_args = EngineArgs.from_cli_args(ns), ServerArgs.from_cli_args(ns)
    except ValueError as e:
        raise SystemExit(f"kvmosaic serve: error: {e}") from None
    # The whole check (the model's config, the machine's dtype: ~4 s of torch and transformers
    # imports) runs while Ray starts; a bad option still stops the command before anything is deployed.
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvmosaic-check")
    checked = pool.submit(_check, engine_args, server_args)
    pool.shutdown(wait=False)
    return run_replicas(engine_args, server_args, checked)


def _check(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    """The options as an engine checks them; also imports what the app's deployments import."""
    from . import app  # noqa: F401

    engine_args.create_engine_config(**server_args.engine_overrides())


def _signals() -> threading.Event:
    """An event set by SIGTERM/SIGINT (the first signal drains; the second sets ``hurry``)."""
    stop = threading.Event()
    stop.hurry = threading.Event()  # type: ignore[attr-defined]

    def handler(sig: int, _frame) -> None:
        if stop.is_set():
            stop.hurry.set()  # type: ignore[attr-defined]
        log.warning("received %s: draining", signal.Signals(sig).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def drain(front, timeout: float, hurry: threading.Event) -> None:
    """Stop admitting, wait for running requests up to ``timeout``, then cut the rest. A front
    that does not answer (Ray itself going down) ends the drain: nothing is left to wait for."""
    try:
        _drain(front, timeout, hurry)
    except Exception as e:  # noqa: BLE001 - shutting down regardless
        log.warning("drain ended early: %s: %s", type(e).__name__, e)


def _drain(front, timeout: float, hurry: threading.Event) -> None:
    in_flight = front.begin_drain.remote().result(timeout_s=10)
    log.warning("draining: %d requests in flight, up to %g s", in_flight, timeout)
    deadline = time.monotonic() + timeout
    while in_flight and time.monotonic() < deadline and not hurry.is_set():
        time.sleep(0.1)
        in_flight = front.in_flight.remote().result(timeout_s=10)
    if in_flight:
        log.warning("shutdown timeout: ending %d requests with an error", in_flight)
        front.cut_all.remote().result(timeout_s=30)
        end = time.monotonic() + 5
        while in_flight and time.monotonic() < end:
            time.sleep(0.1)
            in_flight = front.in_flight.remote().result(timeout_s=10)


def direct_ingress_env(server_args: ServerArgs) -> tuple[int, dict[str, str]]:
    """The port Ray Serve's HTTP proxy takes, and the environment for the Ray this command
    starts. With direct ingress (a local Ray only: on a joined cluster the front may be placed
    on another node) the front's replica serves ``--port`` itself — Ray Serve allocates it from
    a range of one port — and the proxy, which Ray still starts on the head node, gets a free
    port nobody is told of."""
    if not server_args.direct_ingress or server_args.ray_address:
        return server_args.port, {}
    from ..server.launch import free_port

    grpc = free_port()
    return free_port(), {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(server_args.port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(server_args.port + 1),  # exclusive
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc + 1),
        # Ray holds a stopping ingress open 30 s for load balancers to deregister it; this
        # command has drained the front itself (503 first, then the running requests) by then.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    }


def serve_env(server_args: ServerArgs) -> dict[str, str]:
    """Ray Serve's settings for the app's replicas, on any cluster (a replica reads them as its
    process starts): Serve's low-latency mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED``: user code and
    the handle's router on the replica's own event loop, handles over gRPC, request logs to files
    only; measured, the front's TTFT cost at c=1 +18.5 -> +15.6 ms, BENCHMARKS.md issue 20), with
    direct ingress as ``kvmosaic serve`` decides it (that mode would turn it on everywhere)."""
    direct = server_args.direct_ingress and not server_args.ray_address
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1" if direct else "0"}


def run_replicas(engine_args: EngineArgs, server_args: ServerArgs, checked: Future | None = None) -> int:
    """Serve until SIGTERM / SIGINT, then drain. ``checked``: the engine options' check, run
    beside Ray's start (its error ends the command before Serve starts)."""
    import ray
    from ray import serve

    from ..server.cli import banner

    logging.basicConfig(level=server_args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    proxy_port, env = direct_ingress_env(server_args)
    # Read by the Ray this command starts, and its processes as they start, from this environment.
    os.environ.update({**env, **serve_env(server_args)})
    # Ray runs workers at nice 15 by default: the replicas' engines would then yield a core to any
    # other process, and the front would lose it to them.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=server_args.ray_address, ignore_reinit_error=True, include_dashboard=False,
             log_to_driver=server_args.log_level == "debug")
    stop = _signals()  # after ray.init, which installs its own SIGTERM handler (exit, no drain)
    try:
        if checked is not None:
            try:
                checked.result()
            except ValueError as e:
                raise SystemExit(f"kvmosaic serve: error: {e}") from None
        from .app import build_application

        serve.start(http_options={"host": server_args.host, "port": proxy_port})
        front = serve.run(build_application(engine_args, server_args), name="kvmosaic", route_prefix="/")
        model = serve.get_deployment_handle("EngineReplica", "kvmosaic").served_model_name.remote().result()
        host = "127.0.0.1" if server_args.host in ("0.0.0.0", "::") else server_args.host
        print("\n" + banner(f"http://{host}:{server_args.port}", model, None), flush=True)
        print(f"Replicas: {server_args.replicas} on Ray Serve, routed by {server_args.router}; /metrics has the "
              f"router's and every replica's (label replica)\n", flush=True)
        while not stop.wait(1.0):
            pass
        drain(front, server_args.shutdown_timeout, stop.hurry)  # type: ignore[attr-defined]
    finally:
        serve.shutdown()
        ray.shutdown()
    log.warning("drained; exiting")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmosaic.serve")
    add_arguments(p)
    ns = p.parse_args(argv)
    ns.replicas = ns.replicas or 2
    return run(ns)
