"""The HTTP ingress of ``kvmosaic.serve``: the OpenAI API in front of the engine replicas.

For each request it authenticates and derives the cache salt (``server.tenancy``), computes
the prompt's token ids with the engine's tokenizer and chat template (``router.prompt_hashes``),
and forwards the untouched body to the replica the router picks. Invariant: a request whose
replica died before answering is sent again, elsewhere (a non-streamed answer is only returned
once complete, so nothing was returned to the client yet); up to ``retries`` times.

The router runs in this process (Ray Serve runs a handle's ``RequestRouter`` where the handle
is owned); the ingress finds it in ``serve.state`` to count the replica's reported
``cached_tokens`` against the router's prediction, and to serve ``/metrics`` and
``/router/state`` (the index per replica, and with ``?pools=1`` what each replica's pool holds).
"""


import json
import logging
import os
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from ..router.prompt_hashes import prompt_token_ids
from . import state as serve_state

log = logging.getLogger("kvmosaic.serve")
api = FastAPI(title="kvmosaic (replicas)")


def load_tokenizer_for(model: str | None):
    from ..model.loader import shipped_model_path
    from ..model.tokenizer import load_tokenizer

    path = model or shipped_model_path()
    if os.path.isfile(path):
        return load_tokenizer(os.path.dirname(path), os.path.basename(path))
    return load_tokenizer(path, None)


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, engines, model: str | None, api_keys: list[str], salt_secret: str | None,
                 retries: int = 3) -> None:
        from ..server.tenancy import TenantPolicy

        self.engines, self.retries = engines, retries
        self.tenants = TenantPolicy(frozenset(api_keys), salt_secret.encode() if salt_secret else None)
        self.tokenizer = load_tokenizer_for(model)

    async def _forward(self, request: Request, chat: bool) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}
        routed: dict[str, Any] = {"path": request.url.path, "body": body, "headers": headers, "key": uuid.uuid4().hex}
        try:  # the replica's app gives the errors (401, 400, ...); here only routing data
            parsed = json.loads(body)
            token = self.tenants.authenticate(request.headers.get("authorization"))
            routed["cache_salt"] = self.tenants.cache_salt(token, parsed.get("cache_salt"))
            routed["token_ids"] = prompt_token_ids(self.tokenizer, parsed, chat)
        except Exception:  # noqa: BLE001 - an invalid request is answered by the replica
            routed["token_ids"] = []
        for attempt in range(self.retries + 1):
            try:
                out = await self.engines.handle.remote(routed)
                break
            except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
                log.warning("replica died before answering (attempt %d): %s", attempt + 1, e)
                router = self.router()
                if router is not None:
                    router.predicted.pop(routed["key"], None)
                    router.finished(routed["key"])
                if attempt == self.retries:
                    return JSONResponse({"error": {"message": "no replica could answer", "code": 503}}, 503)
        self._observe(routed, out)
        return Response(out["body"], out["status"], media_type=out["content_type"],
                        headers={"x-kvmosaic-replica": out["replica"], "x-kvmosaic-attempts": str(attempt + 1)})

    def router(self):
        """The ``KVMosaicRouter`` of this process (None before the first request made it)."""
        return serve_state.get(self.engines.deployment_name)

    def _observe(self, routed: dict, out: dict) -> None:
        router = self.router()
        if router is None:
            return
        router.finished(routed["key"])
        predicted = router.predicted.pop(routed["key"], None)
        if out["status"] != 200 or "json" not in (out["content_type"] or ""):
            return
        usage = json.loads(out["body"]).get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if predicted is not None and cached is not None:
            router.metrics.answered(predicted, cached)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._forward(request, chat=True)

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics(self) -> Response:
        router = self.router()
        text = generate_latest(router.metrics.registry) if router else b""
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @api.get("/router/state")
    async def router_state(self, pools: bool = False) -> dict:
        """The router's view: per replica its pid, freshness, gaps and indexed block hashes
        (hex); with ``pools``, also what each replica's pool holds (asked of it, pinned)."""
        router = self.router()
        if router is None:
            return {"router": None, "replicas": {}}
        with router.follower.lock:
            replicas = {rid: {"pid": router.pids.get(rid), "fresh": router.index.fresh(rid), "gaps": view.gaps,
                              "stale": view.stale, "next_seq": view.next_seq,
                              "index": sorted(h.hex() for h in view.blocks.parent)}
                        for rid, view in router.index.replicas.items()}
        out = {"router": router.policy_name, "replicas": replicas, "pids": dict(router.pids),
               "inflight": dict(router.inflight_requests)}
        if pools:
            out["pools"] = {}
            for rid in list(router.pids):
                try:
                    got_rid, hashes = await self.engines.pool_hashes.remote({"pin": rid})
                except (ActorDiedError, ActorUnavailableError, RayActorError):
                    continue
                if got_rid == rid:
                    out["pools"][rid] = sorted(h.hex() for h in hashes)
        return out
