"""``/dashboard``: the live cache explorer (issue 23), served by the server itself.

* ``GET /dashboard``: one static page (``static/dashboard.html``, package data: plain JS and
  inline SVG, no CDN, no build step) that polls
* ``GET /dashboard/state`` once a second (:func:`.dashboard_state.cache_state`), and posts to
* ``POST /dashboard/explain`` ``{"prompt", "api_key"?, "cache_salt"?}``: block by block where
  that prompt would hit in the live cache, from which tier, and why it would stop
  (:func:`kvmosaic.cache.probe.probe`: reads only, changes nothing).

All three are the admin's: with keys configured, 401 without a credential (with
``WWW-Authenticate: Basic``, so a browser asks: any user name, the admin key as password) and
403 for a tenant key; a bearer token works as on every other route. Without keys they are open,
as ``/metrics`` is. Token text of cached blocks appears only with ``--dashboard-show-text``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from .async_engine import AsyncEngine
from .dashboard_state import cache_state
from .errors import APIError
from .tenancy import TenantPolicy

MAX_PROMPT_CHARS = 200_000
BASIC = {"WWW-Authenticate": 'Basic realm="kvmosaic dashboard"'}


def page() -> str:
    return resources.files("kvmosaic.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")


def bearer_of(authorization: str | None) -> str | None:
    """``Basic base64(user:key)`` becomes ``Bearer key``; anything else is passed on unchanged."""
    if authorization is None or authorization[:6].lower() != "basic ":
        return authorization
    try:
        user_key = base64.b64decode(authorization[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise APIError(401, "malformed Basic credentials", code="invalid_api_key", headers=BASIC) from None
    return "Bearer " + user_key.partition(":")[2]


def require_admin(tenants: TenantPolicy, request: Request) -> None:
    try:
        tenants.require_admin(bearer_of(request.headers.get("authorization")), "/dashboard")
    except APIError as e:
        if e.status == 401:
            e.headers = {**(e.headers or {}), **BASIC}
        raise


def add_page_routes(app: FastAPI, tenants: TenantPolicy, state: Callable[[Request], Awaitable[dict]]) -> None:
    """``/dashboard`` (the page) and ``/dashboard/state`` (what ``state`` returns), admin only:
    one server's and the replicas' front's alike."""
    html = page()

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> HTMLResponse:
        require_admin(tenants, request)
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/state")
    async def dashboard_state(request: Request) -> dict:
        """The cache explorer's snapshot (admin only)."""
        require_admin(tenants, request)
        return await state(request)


def add_dashboard_routes(app: FastAPI, engine: AsyncEngine, tenants: TenantPolicy, show_text: bool = False,
                         top_n: int = 10) -> None:
    async def state(_request: Request) -> dict:
        return await engine.call(lambda e: cache_state(e, show_text, top_n))

    add_page_routes(app, tenants, state)

    @app.post("/dashboard/explain")
    async def dashboard_explain(request: Request) -> dict:
        """Where a prompt would hit in the live cache, block by block (admin only; reads only)."""
        require_admin(tenants, request)
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            raise APIError(400, "the body must be JSON: {\"prompt\": ...}") from None
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_PROMPT_CHARS:
            raise APIError(400, f"'prompt' must be a non-empty string of at most {MAX_PROMPT_CHARS} characters",
                           "prompt")
        key, salt = body.get("api_key") or None, body.get("cache_salt") or None
        if not all(v is None or isinstance(v, str) for v in (key, salt)):
            raise APIError(400, "'api_key' and 'cache_salt' must be strings")
        inner = engine.engine
        ids = await asyncio.to_thread(lambda: inner.inputs.process(prompt, None).prompt_token_ids)
        ns_salt = tenants.cache_salt(key, salt)

        def run(e):
            from ..cache.probe import probe

            stack = e.tiers.stack if e.tiers is not None else None
            return probe(e.cache, e.watch, ids, ns_salt, None, stack, e.tokenizer.decode)

        if inner.watch is None:
            raise APIError(409, "miss reasons are off (--no-miss-reasons): nothing to explain with")
        return await engine.call(run)
