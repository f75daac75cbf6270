"""A cap on request body size, enforced before the body is read into memory.

A declared ``Content-Length`` over the cap is refused at once; a body without one (chunked)
is counted as it arrives and refused as soon as it passes the cap. Either way: 413, in
OpenAI's error shape.

Also here (issue 14): header count and size caps (:class:`HeaderLimits`), a body read
timeout (:class:`BodyReadTimeout`) and the HTTP protocol with a header read timeout
(:class:`GuardedH11Protocol`).
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

log = logging.getLogger("kvmosaic.server")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"the request body is larger than this server accepts ({self.max_bytes} bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            body = json.dumps(error_body(413, self._too_large())).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, counting_receive, send)


class HeaderLimits:
    """Header count and size caps, answered in OpenAI's shape (431) where the app still can;
    beyond ``h11_max_incomplete_event_size`` the HTTP parser refuses first (see
    :class:`GuardedH11Protocol`)."""

    def __init__(self, app: ASGIApp, max_count: int = 100, max_bytes: int = 16 << 10) -> None:
        self.app = app
        self.max_count = max_count
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(k) + len(v) + 4 for k, v in headers)
            if len(headers) > self.max_count or size > self.max_bytes:
                msg = (f"the request has {len(headers)} headers ({size} bytes); this server accepts at most "
                       f"{self.max_count} headers and {self.max_bytes} bytes of them")
                body = json.dumps(error_body(431, msg)).encode()
                await send({"type": "http.response.start", "status": 431,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class BodyReadTimeout:
    """A body that does not arrive in time (``timeout`` seconds between two pieces) ends
    the request with 408. Only while the body is incomplete: once it is in, ``receive``
    waits for the disconnect of a long stream, which must not time out."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        complete = False

        async def timed_receive() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                log.info("client %s: no request body for %.0f s; answering 408", _client(scope), self.timeout)
                raise HTTPException(408, f"the request body did not arrive within {self.timeout:g} s") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        await self.app(scope, timed_receive, send)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


def _raw_error(status: int, phrase: str, message: str) -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header read timeout (a connection that has not sent a
    complete request head within ``header_timeout`` seconds gets 408 and is closed; uvicorn
    itself waits forever) and OpenAI-shaped 400s for requests the parser refuses (e.g. a
    head over ``h11_max_incomplete_event_size``)."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the head is complete: the body has its own timeout

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # idle: uvicorn's keep-alive timeout applies

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        log.info("client %s: no complete request head within %.0f s; closing", self.client, self.header_timeout)
        self.transport.write(_raw_error(408, "Request Timeout",
                                        f"the request head did not arrive within {self.header_timeout:g} s"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        log.info("client %s: %s", self.client, msg)
        self.transport.write(_raw_error(400, "Bad Request", f"{msg} (malformed, or a request head over "
                                                            f"{self.conn._max_incomplete_event_size} bytes)"))
        self.transport.close()
