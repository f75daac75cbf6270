"""Build the ``kvmosaic.serve`` application: N engine replicas behind the front.

* :func:`build_app` is a Ray Serve *application builder*: it takes one args dict, so a Serve
  config file runs it as it stands::

      applications:
        - name: kvmosaic
          route_prefix: /
          import_path: kvmosaic.serve.app:build_app
          args: {replicas: 2, router: cache-aware, dtype: float32, api_key: [KEY_A, KEY_B]}

  (``serve run config.yaml``). The keys are the field names of ``EngineArgs`` and
  ``ServerArgs`` (the ``kvmosaic serve`` flags with ``_`` for ``-``); an unknown key is an error.
* :func:`build_application` takes the two argument objects themselves (``kvmosaic serve``).

Each replica asks for ``replica_cpus`` CPUs (0.5: two fit on a 2-core machine) and runs torch on
``num_threads`` threads (default: its whole CPUs, at least one).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from ..engine.arg_utils import EngineArgs
from ..router.policies import POLICIES
from ..server.args import ServerArgs
from .cli import serve_env
from .ingress import OpenAIIngress
from .replica import EngineReplica

ROUTER_CLASS = "kvmosaic.serve.request_router.KVMosaicRouter"


def split_args(args: dict[str, Any]) -> tuple[EngineArgs, ServerArgs]:
    """An args dict (Serve config, Python) -> ``(EngineArgs, ServerArgs)``; ValueError names
    the keys that are neither."""
    args = {k.replace("-", "_"): v for k, v in (args or {}).items()}
    engine_keys = {f.name for f in fields(EngineArgs)}
    server_keys = {f.name for f in fields(ServerArgs)}
    unknown = sorted(set(args) - engine_keys - server_keys)
    if unknown:
        raise ValueError(f"unknown kvmosaic options {unknown}; see 'kvmosaic serve --help' (with _ for -)")
    for key in ("api_key", "admin_key", "kv_tiers", "kv_events_curve_client_key"):
        if isinstance(args.get(key), str):
            args[key] = [args[key]]
    server = ServerArgs(**{k: v for k, v in args.items() if k in server_keys})
    server.replicas = server.replicas or 2
    return EngineArgs(**{k: v for k, v in args.items() if k in engine_keys}), server


# How often a stopping replica looks whether its requests have ended (Serve's default, 2 s, is also
# the least every replica waits: `kvmosaic serve` has drained the front before it stops Serve).
SHUTDOWN_POLL_S = 0.2


def build_application(engine_args: EngineArgs, server_args: ServerArgs, router_kwargs: dict | None = None,
                      stats_period_s: float = 0.2):
    if server_args.router not in POLICIES:
        raise ValueError(f"unknown router {server_args.router!r}; choose one of {sorted(POLICIES)}")
    placement: dict[str, Any] = {}
    if server_args.max_replicas_per_node:
        placement["max_replicas_per_node"] = server_args.max_replicas_per_node
    replicas = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=server_args.replicas or 2, max_ongoing_requests=256,
        ray_actor_options={"num_cpus": server_args.replica_cpus, "runtime_env": {"env_vars": serve_env(server_args)}},
        **placement,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"policy": server_args.router, **(router_kwargs or {})},
            request_routing_stats_period_s=stats_period_s, request_routing_stats_timeout_s=5.0),
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
    front = OpenAIIngress.options(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": serve_env(server_args)}},
                                  graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
    return front.bind(replicas.bind(engine_args, server_args), engine_args, server_args)


def build_app(args: dict[str, Any]):
    """Ray Serve's application builder (one args dict; see the module docstring). Its front is
    reached through Serve's HTTP proxy: direct ingress is ``kvmosaic serve``'s own, which sets up
    the Ray it starts for it (the port, a short draining period). A front left in that mode on
    another's Ray held every shutdown for Serve's whole grace period (20 s) before it was killed."""
    engine_args, server_args = split_args({"direct_ingress": False, **(args or {})})
    if server_args.direct_ingress:
        raise ValueError("direct_ingress is for the Ray that 'kvmosaic serve' starts; an app built from a "
                         "Serve config is reached through Serve's HTTP proxy (http_options)")
    return build_application(engine_args, server_args)
