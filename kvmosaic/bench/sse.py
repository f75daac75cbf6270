"""A streamed OpenAI answer read as it arrives, for the one-off benchmarks (``benchmarks/``):
plain httpx and server-sent events, so a figure sees each chunk when the client does."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx


def content_deltas(client: httpx.Client, path: str, body: dict, headers: dict | None = None) -> Iterator[tuple[float, str]]:
    """``(perf_counter time, text)`` of each chunk with content of the stream ``body`` asks
    ``path`` for (a completion's ``text``, a chat delta's ``content``); raises on a non-200."""
    with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"]
            text = (choice[0].get("text") or (choice[0].get("delta") or {}).get("content")) if choice else None
            if text:
                yield time.perf_counter(), text
