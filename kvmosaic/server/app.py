"""The FastAPI application: routes only; the work is in :mod:`serving`.

``/health`` and ``/metrics`` report the engine's counters as taken between two steps at the
time of the request: ``kv.num_used_blocks == 0`` with no request running means nothing
holds a block.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import errors
from .async_engine import AsyncEngine
from .errors import APIError
from .limits import BodySizeLimit
from .metrics import ServerMetrics
from .serving import OpenAIServing
from .tenancy import TenantPolicy


def build_app(
    engine: AsyncEngine,
    model_name: str,
    metrics: ServerMetrics,
    tenants: TenantPolicy | None = None,
    max_body_bytes: int = 1 << 20,
) -> FastAPI:
    tenants = tenants or TenantPolicy()
    serving = OpenAIServing(engine, model_name, tenants)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="kvmosaic", lifespan=lifespan)
    errors.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)

    @app.get("/health")
    async def health() -> dict:
        st = await engine.refresh_stats()
        return {"status": "ok", "model": model_name,
                "requests": {"running": st.num_running, "waiting": st.num_waiting},
                "kv": {"num_blocks": st.num_blocks, "num_used_blocks": st.num_blocks - st.num_free_blocks,
                       "num_free_blocks": st.num_free_blocks, "num_cached_blocks": st.num_cached_blocks,
                       "usage": st.kv_cache_usage}}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        tenants.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "kvmosaic",
            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat(request)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        tenants.authenticate(request.headers.get("authorization"))
        if not await engine.call(lambda e: e.reset_prefix_cache()):
            raise APIError(409, "blocks are in use by running requests; retry when the server is idle")
        return JSONResponse({"reset": True})

    @app.get("/metrics")
    async def prometheus() -> Response:
        await engine.refresh_stats()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
