"""Call an ASGI app in-process and stream its answer: how a replica runs the server's own app
for the Ray front.

:func:`stream_asgi` yields the response head (``{"status", "headers"}``) and then each body
chunk as the app sends it, so a streamed completion leaves the replica token by token (an HTTP
client over an ASGI transport would buffer the whole body). Invariant: if the consumer stops
early (the front's client went away, the Ray generator was cancelled), the app sees
``http.disconnect`` and its task is awaited to the end, so the server's own clean-up runs (a
stream aborts its engine request and frees its blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

Headers = list[tuple[str, str]]


def http_scope(method: str, path: str, headers: Headers, client: tuple[str, int]) -> dict[str, Any]:
    path, _, query = path.partition("?")
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": query.encode(), "root_path": "", "client": client, "server": ("kvmosaic-replica", 80),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]}


async def stream_asgi(app, method: str, path: str, headers: Headers, body: bytes = b"",
                      client: tuple[str, int] = ("kvmosaic-front", 0)) -> AsyncIterator[dict | bytes]:
    """Run one request through ``app``: yields ``{"status": int, "headers": [(k, v), ...]}``,
    then ``bytes`` chunks. An exception of the app after the head is raised to the consumer."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.create_task(app(http_scope(method, path, headers, client), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]
        task.result()
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=30)
