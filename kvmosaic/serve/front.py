"""The front's HTTP routes (FastAPI), built once per ingress replica from its ``ServerArgs``:
the same middlewares as one server (body size, header caps, body timeout, drain) around
forwarding routes and the front's own views (docs/ARCHITECTURE.md, "Replicas")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..server import errors
from ..server.app import add_request_schemas, request_body
from ..server.drain import RETRY_AFTER_S, DrainMiddleware
from ..server.errors import APIError
from ..server.limits import BodyReadTimeout, BodySizeLimit, HeaderLimits
from ..server.protocol import ChatCompletionRequest, CompletionRequest
from .dashboard_routes import add_front_dashboard, record_route
from .metrics_merge import merge_replica_metrics

if TYPE_CHECKING:
    from .ingress import Answer, OpenAIIngress


def build_front(ingress: OpenAIIngress) -> FastAPI:
    from .ingress import ReplicaUnavailable

    args, tenants, drain = ingress.args, ingress.tenants, ingress.drain
    app = FastAPI(title="kvmosaic (replicas)")
    errors.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=args.max_body_bytes)
    app.add_middleware(BodyReadTimeout, timeout=args.body_timeout)
    app.add_middleware(DrainMiddleware, drain=drain)
    app.add_middleware(HeaderLimits)

    def respond(answer: Answer) -> Response:
        headers = {**answer.headers, "x-kvmosaic-replica": answer.replica,
                   "x-kvmosaic-attempts": str(answer.attempts)}
        if answer.streaming:
            return StreamingResponse(ingress.relay(answer), answer.status, headers=headers)
        return Response(answer.body, answer.status, headers=headers)

    async def forward(request: Request, chat: bool | None = None) -> Response:
        body = await request.body()
        headers = dict(request.headers)
        extra = await ingress.routing_data(headers, body, chat) if chat is not None else None
        try:
            answer = await ingress.ask(request.method, request.url.path, headers, body, extra)
            record_route(app, tenants, request, answer.replica)  # for the cache explorer (issue 23)
            return respond(answer)
        except ReplicaUnavailable as e:
            raise APIError(503, str(e), code="no_replica", headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    # The bodies are forwarded as they came (a replica parses them, off its event loop); the
    # schema says what they must hold, as one server's does (clients, fuzzers).
    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await forward(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        return await forward(request, chat=True)

    add_request_schemas(app, CompletionRequest, ChatCompletionRequest)

    async def forward_as_is(request: Request) -> Response:
        return await forward(request)

    # Routes any replica answers alike: /v1/models and vLLM's utility routes
    # (server/utility_routes.py).
    for path, method in [("/v1/models", "GET"), ("/v1/models/{model_id:path}", "GET"), ("/tokenize", "POST"),
                         ("/detokenize", "POST"), ("/version", "GET")]:
        app.add_api_route(path, forward_as_is, methods=[method])

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """200 while the front admits (it drains as one server does)."""
        return Response(status_code=503 if drain.draining else 200,
                        headers={"Retry-After": str(RETRY_AFTER_S)} if drain.draining else None)

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "ok"}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200 while some replica can serve and the front admits; 503 otherwise. The admin (or
        anyone, without keys) sees each replica's own ``/health``."""
        auth = request.headers.get("authorization")
        answers = await ingress.each_replica("GET", "/health", dict(request.headers))
        ok = [rid for rid, a in answers.items() if a is not None and a.status == 200]
        status = "draining" if drain.draining else ("ok" if ok else "unavailable")
        body: dict = {"status": status}
        if not tenants.keys_configured or tenants.is_admin(auth):
            router = ingress.router()
            body.update(router=router.policy_name if router else None, draining=drain.draining, replicas={
                rid: a.json() if a is not None and a.body else {"status": "unreachable"}
                for rid, a in answers.items()})
        code = 200 if status == "ok" else 503
        return JSONResponse(body, code, headers={"Retry-After": str(RETRY_AFTER_S)} if code == 503 else None)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """The router's metrics, then every replica's engine, cache and tier metrics labelled
        ``replica`` (the admin key is needed when keys are set)."""
        tenants.require_admin(request.headers.get("authorization"), "/metrics")
        router = ingress.router()
        own = generate_latest(router.metrics.registry) if router else b""
        answers = await ingress.each_replica("GET", "/metrics", dict(request.headers))
        texts = {rid: a.body.decode() for rid, a in answers.items() if a is not None and a.status == 200}
        return Response(own + merge_replica_metrics(texts), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        """Every replica's; 409 when some had blocks in use (those kept their cache)."""
        auth = request.headers.get("authorization")
        if tenants.keys_configured and tenants.role(auth) == "tenant":
            raise APIError(403, "resetting the prefix cache clears every tenant's namespace and needs the admin "
                                "key", code="forbidden")
        tenants.require_admin(auth, "/reset_prefix_cache")
        answers = await ingress.each_replica("POST", "/reset_prefix_cache", dict(request.headers))
        busy = [rid for rid, a in answers.items() if a is None or a.status != 200]
        if busy:
            raise APIError(409, f"{len(busy)} of {len(answers)} replicas could not reset (blocks in use by running "
                                f"requests, or unreachable); retry when the server is idle")
        return JSONResponse({"reset": True, "replicas": len(answers)})

    @app.get("/router/state")
    async def router_state(request: Request, pools: bool = False) -> dict:
        tenants.require_admin(request.headers.get("authorization"), "/router/state")
        return await ingress.router_state(pools)

    if args.dashboard:
        add_front_dashboard(app, ingress)
    return app
