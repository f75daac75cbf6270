"""Build the ``kvmosaic.serve`` application: N engine replicas behind the ingress.

``build_app(...)`` returns a Ray Serve ``Application`` (put it in your own Serve config, or run
it with ``serve.run``). Each replica asks for ``replica_cpus`` CPUs (0.5: two fit on a 2-core
machine) and runs the engine with ``num_threads`` torch threads.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from .ingress import OpenAIIngress
from .replica import EngineReplica

ROUTER_CLASS = "kvmosaic.serve.request_router.KVMosaicRouter"


def build_app(num_replicas: int = 2, router: str = "cache-aware", engine_kwargs: dict[str, Any] | None = None,
              replica_cpus: float = 0.5, api_keys: list[str] | None = None, salt_secret: str | None = None,
              stats_period_s: float = 0.2, router_kwargs: dict[str, Any] | None = None):
    engine_kwargs = {"num_threads": 1, **(engine_kwargs or {})}
    replicas = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=num_replicas, max_ongoing_requests=256, ray_actor_options={"num_cpus": replica_cpus},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS, request_router_kwargs={"policy": router, **(router_kwargs or {})},
            request_routing_stats_period_s=stats_period_s, request_routing_stats_timeout_s=5.0),
        health_check_period_s=2.0, health_check_timeout_s=30.0)
    return OpenAIIngress.bind(replicas.bind(engine_kwargs), engine_kwargs.get("model"), api_keys or [], salt_secret)
