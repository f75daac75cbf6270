"""Graceful drain (issue 14): on SIGTERM stop admitting, let running requests finish up to
``--shutdown-timeout`` seconds, then end the rest with an explicit error, then exit.

* while draining, a new generation request gets 503 with ``Retry-After`` in OpenAI's shape
  (the listening socket stays open until the drain ends, so clients are told, not reset);
* requests still running at the deadline are cut through :meth:`AsyncEngine.cut_all`: a
  stream gets an error event (``code: "shutdown"``) and ``[DONE]``, a non-streaming request
  an OpenAI-shaped 503; never a silent cut;
* a second SIGTERM or SIGINT cuts at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from .async_engine import AsyncEngine
from .errors import error_body

log = logging.getLogger("kvmosaic.server")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
RETRY_AFTER_S = 5
CUT_MESSAGE = "the server is shutting down and could not finish this request in time; retry it"


class Drain:
    """Shared state: whether the server drains, and how many generation requests are in
    flight (counted by :class:`DrainMiddleware`, streams until their last byte)."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.draining = False
        self.in_flight = 0
        self.on_reject: Callable[[str], None] = lambda reason: None


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            self.drain.on_reject("draining")
            body = json.dumps(error_body(503, "the server is shutting down and accepts no new requests; retry "
                                              "on another replica or later", code="server_shutting_down")).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT drains instead of exiting at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.drain = drain
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        if self.drain.draining:  # a second signal: cut now
            self._hurry = True
            return
        self._captured_signals.append(sig)
        self.drain.draining = True
        log.warning("received %s: draining (%d requests in flight, up to %g s)",
                    signal.Signals(sig).name, self.drain.in_flight, self.drain.timeout)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain.timeout
        while self.drain.in_flight and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        if self.drain.in_flight:
            log.warning("shutdown timeout: ending %d requests with an error", self.drain.in_flight)
            self.engine.cut_all(CUT_MESSAGE, 503, "shutdown")
            end = time.monotonic() + 5
            while self.drain.in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        log.warning("drained; exiting")
        self.should_exit = True
