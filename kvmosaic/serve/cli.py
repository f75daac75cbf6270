"""``kvmosaic serve``: one engine process (``server.cli``), or with ``--replicas N --router
POLICY`` the replicated server on a local Ray.

Starts a local Ray when none is running (``ray.init`` does), deploys ``app.build_app`` and
serves the OpenAI API on ``--host``/``--port`` until interrupted, then shuts Serve down. This
package sits above ``server`` (its replicas run the server's app), so the command lives here.
"""

from __future__ import annotations

import argparse
import time

from ..router.policies import POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..server.cli import add_arguments as add_server_arguments

    add_server_arguments(p)
    g = p.add_argument_group("replicas (Ray Serve)")
    g.add_argument("--replicas", type=int, default=None, help="run N engine replicas on Ray Serve")
    g.add_argument("--router", default="cache-aware", choices=POLICIES, help="how requests pick a replica")
    g.add_argument("--replica-cpus", type=float, default=0.5)


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("model", "dtype", "device", "block_size", "kv_cache_memory", "num_kv_blocks", "max_model_len",
            "max_num_seqs", "max_num_batched_tokens", "prefix_cache", "scheduling_policy", "num_threads", "quantization")
    out = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    out.setdefault("num_threads", 1)
    return out


def run(args: argparse.Namespace) -> int:
    if not args.replicas:
        from ..server.cli import run as run_single

        return run_single(args)
    return run_replicas(args)


def run_replicas(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from .app import build_app

    ray.init(ignore_reinit_error=True, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(args.replicas, args.router, engine_kwargs(args), args.replica_cpus,
                    list(getattr(args, "api_key", []) or []), getattr(args, "api_key_salt", None))
    serve.run(app, name="kvmosaic", route_prefix="/")
    print(f"kvmosaic is serving {args.replicas} replicas ({args.router} router) at "
          f"http://{args.host}:{args.port} (OpenAI API under /v1; router metrics at /metrics)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmosaic.serve")
    add_arguments(p)
    args = p.parse_args(argv)
    args.replicas = args.replicas or 2
    return run_replicas(args)
