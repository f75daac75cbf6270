"""The cache explorer on the replicas' front (issue 23): the same page as one server's, fed by
every replica's ``/dashboard/state`` merged (:mod:`.dashboard_merge`) plus where the front sent
its last requests; the live explain asks every replica and answers with the one that would
serve the most tokens (the others' counts beside it). Admin only, as on one server."""

from __future__ import annotations

import json
import time
from collections import deque

from fastapi import FastAPI, Request

from ..server.dashboard import add_page_routes, require_admin
from ..server.errors import APIError
from .dashboard_merge import merge_states

MAX_ROUTES = 50


def record_route(app: FastAPI, tenants, request: Request, replica: str) -> None:
    """Remember where a request went (path, replica, tenant label): the last ``MAX_ROUTES``."""
    routes = getattr(app.state, "routes", None)
    if routes is None:
        routes = app.state.routes = deque(maxlen=MAX_ROUTES)
    auth = request.headers.get("authorization") or ""
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    routes.append({"time": time.time(), "path": request.url.path, "replica": replica,
                   "tenant": tenants.tenant_label(token)})


def add_front_dashboard(app: FastAPI, ingress) -> None:
    tenants = ingress.tenants

    async def state(request: Request) -> dict:
        """Every replica's snapshot, merged, with where the front sent the last requests."""
        answers = await ingress.each_replica("GET", "/dashboard/state", dict(request.headers))
        states = {rid: a.json() for rid, a in answers.items() if a is not None and a.status == 200}
        return merge_states(states, list(getattr(app.state, "routes", ())))

    add_page_routes(app, tenants, state)

    @app.post("/dashboard/explain")
    async def dashboard_explain(request: Request) -> dict:
        require_admin(tenants, request)
        body = await request.body()
        ids = await ingress.replica_ids()
        got = {}
        for rid in ids:
            a = await ingress.ask("POST", "/dashboard/explain", dict(request.headers), body, pin=rid)
            if a.status != 200:
                raise APIError(a.status, json.loads(a.body or b"{}").get("error", {}).get("message", "explain failed"))
            got[rid] = a.json()
        if not got:
            raise APIError(503, "no replica answered", code="no_replica")
        best = max(got, key=lambda r: got[r]["pool_tokens"] + got[r]["tier_tokens"])
        return {**got[best], "replica": best,
                "per_replica": {r: {"pool_tokens": g["pool_tokens"], "tier_tokens": g["tier_tokens"]} for r, g in got.items()}}
