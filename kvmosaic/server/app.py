"""The FastAPI application: routes only; the work is in :mod:`serving`.

``/health`` and ``/metrics`` report the engine's counters as taken between two steps at the
time of the request: ``kv.num_used_blocks == 0`` with no request running means nothing
holds a block.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

from . import errors
from .async_engine import AsyncEngine
from .dashboard import add_dashboard_routes
from .drain import RETRY_AFTER_S, Drain, DrainMiddleware
from .errors import APIError
from .limits import BodyReadTimeout, BodySizeLimit, HeaderLimits
from .metrics import ServerMetrics
from .metrics_cache import CacheLensCollector
from .metrics_vllm import attach as attach_vllm_metrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import OpenAIServing
from .tenancy import TenantPolicy, build_public_prefixes, read_public_prefix_file
from .tenant_limits import TenantLimits
from .utility_routes import add_utility_routes, model_card

if TYPE_CHECKING:
    from .args import ServerArgs


def build_server(engine: AsyncEngine, args: ServerArgs, model_name: str | None = None,
                 metrics: ServerMetrics | None = None, drain: Drain | None = None) -> FastAPI:
    """The server's app as ``args`` describe it: tenancy (with its public prefixes), limits,
    drain. One process and every Ray replica are built by this function (docs/ARCHITECTURE.md)."""
    model_name = model_name or args.served_model_name or engine.engine.model_name
    if metrics is None:
        metrics = ServerMetrics(lambda: engine.stats, model_name)
        engine.on_finish = metrics.on_finish
    exposed = attach_vllm_metrics(engine, metrics, args.metrics_prefix).exposed
    tenants = args.tenant_policy()
    if tenants.mode == "shared-public":
        texts, hashes = read_public_prefix_file(args.public_prefix_file) if args.public_prefix_file else ([], [])
        tenants.public = build_public_prefixes(engine.engine, texts, hashes)
    limits = TenantLimits(args.tenant_max_requests, args.tenant_max_queued_tokens, metrics.tenant_over_limit)
    # issue 23: miss reasons and per-tenant figures on /metrics; the cache explorer
    metrics.registry.register(CacheLensCollector(lambda: engine.stats, model_name, args.metrics_top_tenants))
    app = build_app(engine, model_name, metrics, tenants, args.max_body_bytes,
                    drain=drain or Drain(args.shutdown_timeout), body_timeout=args.body_timeout, limits=limits,
                    exposed=exposed, tool_parser=args.tool_call_parser,
                    auto_tools=args.enable_auto_tool_choice)
    if args.dashboard:
        add_dashboard_routes(app, engine, tenants, args.dashboard_show_text, args.metrics_top_tenants)
    return app


def request_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route that reads its body itself (off the event loop, see
    :mod:`serving`): the body's schema is the pydantic model's, under ``components``."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def add_request_schemas(app: FastAPI, *models: type[BaseModel]) -> None:
    """Put ``models``' JSON schemas (and the models they use) into ``/openapi.json``'s
    ``components``, so the routes' ``request_body`` references resolve (clients, fuzzers)."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(
    engine: AsyncEngine,
    model_name: str,
    metrics: ServerMetrics,
    tenants: TenantPolicy | None = None,
    max_body_bytes: int = 1 << 20,
    drain: Drain | None = None,
    body_timeout: float = 30.0,
    limits: TenantLimits | None = None,
    exposed: CollectorRegistry | None = None,
    tool_parser: str | None = None,
    auto_tools: bool = False,
) -> FastAPI:
    """``exposed``: the registry /metrics serves (default ``metrics.registry``; build_server
    gives the one with vLLM's metrics and the configured prefix)."""
    tenants = tenants or TenantPolicy()
    drain = drain or Drain()
    drain.on_reject = lambda reason: metrics.count("rejected", reason)
    engine.on_count = metrics.count
    serving = OpenAIServing(engine, model_name, tenants, limits, tool_parser, auto_tools)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="kvmosaic", lifespan=lifespan)
    errors.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    # issue 14: outermost first: header caps, drain (503 + Retry-After), body read timeout
    app.add_middleware(BodyReadTimeout, timeout=body_timeout)
    app.add_middleware(DrainMiddleware, drain=drain)
    app.add_middleware(HeaderLimits)
    app.state.drain = drain

    @app.get("/health/live")
    async def live() -> dict:
        """Liveness (a Kubernetes ``livenessProbe``): 200 while the process answers, draining
        included, so that a probe never restarts a replica in the middle of its drain."""
        return {"status": "ok"}

    @app.get("/health")
    async def health(request: Request):
        """Readiness (a Kubernetes ``readinessProbe``, a router's or load balancer's check):
        200 ``{"status": "ok"}`` while the server admits requests; 503 ``{"status": "draining"}``
        with ``Retry-After`` once SIGTERM started the drain, so traffic is routed elsewhere while
        running requests finish (liveness stays 200 on ``/health/live``). With keys configured,
        only the admin sees load and cache state (they move with other tenants' traffic); anyone
        else gets the bare status."""
        auth = request.headers.get("authorization")
        status = "draining" if drain.draining else "ok"
        if tenants.keys_configured and not tenants.is_admin(auth):
            body = {"status": status}
        else:
            st = await engine.refresh_stats()
            body = {"status": status, "model": model_name, "draining": drain.draining,
                    "requests": {"running": st.num_running, "waiting": st.num_waiting},
                    "kv": {"num_blocks": st.num_blocks, "num_used_blocks": st.num_blocks - st.num_free_blocks,
                           "num_free_blocks": st.num_free_blocks, "num_cached_blocks": st.num_cached_blocks,
                           "usage": st.kv_cache_usage, "num_allocated_slots": st.kv_slots_allocated,
                           "num_used_slots": st.kv_slots_used},
                    "kv_tiers": {name: {k: t.get(k) for k in ("medium", "state", "policy", "used_bytes", "capacity_bytes")}
                                 for name, t in (getattr(st, "kv_tiers", None) or {}).get("tiers", {}).items()}}
        if drain.draining:
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return body

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        tenants.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [model_card(model_name, created, engine.max_model_len)]}

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request):
        return await serving.completions(request)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await serving.chat(request)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        auth = request.headers.get("authorization")
        if tenants.keys_configured and tenants.role(auth) == "tenant":
            raise APIError(403, "resetting the prefix cache clears every tenant's namespace and needs the admin "
                                "key; a namespace-scoped reset is not supported (the hash index does not record "
                                "namespaces)", code="forbidden")
        tenants.require_admin(auth, "/reset_prefix_cache")
        if not await engine.call(lambda e: e.reset_prefix_cache()):
            raise APIError(409, "blocks are in use by running requests; retry when the server is idle")
        return JSONResponse({"reset": True})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        tenants.require_admin(request.headers.get("authorization"), "/metrics")
        await engine.refresh_stats()
        return Response(generate_latest(exposed or metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_utility_routes(app, serving, drain, created)  # /tokenize, /detokenize, /version, /ping, /v1/models/{id}
    add_request_schemas(app, CompletionRequest, ChatCompletionRequest)
    return app
