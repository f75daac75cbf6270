"""The load generator of ``kvmosaic bench serve`` (see :mod:`.serving`): streaming chat clients
drive one peer's server at one load level (closed loop at N clients, or Poisson arrivals), timing
each request's chunks, and sample kvmosaic's KV pool from ``/health`` meanwhile.

Two clients (``--client``), the same requests and the same timing: ``aiohttp`` reads the
server-sent events as vLLM's ``vllm bench serve`` does (a line, ``json.loads``), and ``openai`` is
the official ``AsyncOpenAI`` client, which builds a typed object per chunk. The client shares the
machine with the server it measures: on two cores ``openai``'s ~0.46 ms of CPU a chunk against
``aiohttp``'s ~0.21 ms (``benchmarks/client_cost.py``) is taken from the server's decode, whichever
peer it is.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .serve_peers import ServerPeer


@dataclass
class RequestResult:
    ok: bool
    start: float
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds since start, content chunks
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_reported: bool = False  # False: the server sent no usage; prompt_tokens is the client's count
    error: str | None = None


CLIENTS = ("aiohttp", "openai")


def inter_token_gaps(chunk_times: list[float]) -> list[float]:
    """Gaps between consecutive content chunks (the first chunk's arrival is TTFT, not a gap)."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


async def timed(events: AsyncIterator[tuple[bool, tuple[int, int, int] | None]], prompt_estimate: int) -> RequestResult:
    """One streamed request timed as ``events`` yields its chunks — whether a chunk has content,
    and the usage it carries, as (prompt, completion, cached) tokens, or None — counted from the
    moment the first is asked for (which sends the request). A server that sends no usage
    (llama-cpp-python's streams) is counted by the client: ``prompt_estimate`` (the prompt tokenized
    with the model's tokenizer) and one token per content chunk. Any error is a failed result."""
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start)
    try:
        chunks = 0
        async for content, usage in events:
            if content:
                res.chunk_times.append(time.perf_counter() - start)
                chunks += 1
            if usage is not None:
                res.usage_reported = True
                res.prompt_tokens, res.completion_tokens, res.cached_tokens = usage
        res.e2e = time.perf_counter() - start
        res.ttft = res.chunk_times[0] if res.chunk_times else None
        res.completion_tokens = res.completion_tokens or chunks
        res.prompt_tokens = res.prompt_tokens or prompt_estimate
        res.ok = True
    except Exception as err:  # noqa: BLE001 - counted as a failed request and reported
        res.error = f"{type(err).__name__}: {str(err)[:200]}"
    return res


async def one_request(client, peer: ServerPeer, messages: list[dict], max_tokens: int,
                      prompt_estimate: int = 0) -> RequestResult:
    """One streamed chat request through the ``openai`` client (:func:`timed`)."""
    kwargs = {"stream_options": {"include_usage": True}} if peer.usage_option else {}

    async def events():
        stream = await client.chat.completions.create(
            model=peer.model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            extra_body=peer.extra_body or None, **kwargs)
        async for chunk in stream:
            usage = chunk.usage
            details = getattr(usage, "prompt_tokens_details", None)
            yield (bool(chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content),
                   None if usage is None else (usage.prompt_tokens or 0, usage.completion_tokens or 0,
                                               (getattr(details, "cached_tokens", 0) or 0) if details else 0))

    return await timed(events(), prompt_estimate)


async def one_request_sse(session, peer: ServerPeer, messages: list[dict], max_tokens: int,
                          prompt_estimate: int = 0) -> RequestResult:
    """:func:`one_request` through an ``aiohttp`` session: the same body, each ``data:`` line parsed
    as it arrives; a non-200 answer or an error event fails the request."""
    body = {**(peer.extra_body or {}), "model": peer.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    if peer.usage_option:
        body["stream_options"] = {"include_usage": True}

    async def events():
        async with session.post(peer.url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk and not chunk.get("choices"):
                    raise RuntimeError(f"error event: {str(chunk['error'])[:200]}")
                choices, usage = chunk.get("choices"), chunk.get("usage")
                yield (bool(choices and (choices[0].get("delta") or {}).get("content")),
                       None if not usage else (usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0,
                                               (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))

    return await timed(events(), prompt_estimate)


class PoolSampler:
    """Samples kvmosaic's /health while a level runs (blocks in use) beside the client's view of
    the tokens in flight, for the pool utilisation estimate of :data:`.serve_report.POOL_NOTE`."""

    def __init__(self, url: str, block_size: int = 16, period: float = 0.25) -> None:
        self.url, self.block_size, self.period = url, block_size, period
        self.in_flight: dict[int, int] = {}  # request number -> prompt estimate + chunks so far
        self.peak, self.num_blocks, self.utils = 0, None, []

    async def run(self, stop: asyncio.Event) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=5) as http:
            while not stop.is_set():
                try:
                    kv = (await http.get(self.url + "/health")).json()["kv"]
                    used, self.num_blocks = kv["num_used_blocks"], kv["num_blocks"]
                    self.peak = max(self.peak, used)
                    if kv.get("num_allocated_slots"):  # exact, from the engine
                        self.utils.append(kv["num_used_slots"] / kv["num_allocated_slots"])
                    elif used and sum(self.in_flight.values()):  # an estimate (see serve_report.POOL_NOTE)
                        self.utils.append(sum(self.in_flight.values()) / (used * self.block_size))
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), self.period)
                except asyncio.TimeoutError:
                    pass

    def summary(self) -> dict:
        return {"blocks_used_peak": self.peak, "num_blocks": self.num_blocks,
                "pool_util": float(np.median(self.utils)) if self.utils else None}


def open_client(kind: str, peer: ServerPeer):
    """The ``kind`` of :data:`CLIENTS` for ``peer``'s server, and the function that sends one request
    through it; both close with ``await client.close()``."""
    if kind == "openai":
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=peer.url + "/v1", api_key="unused", max_retries=0, timeout=1800), one_request
    if kind == "aiohttp":
        import aiohttp

        # No limit on connections: a level's concurrency is the benchmark's, not the pool's.
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                        connector=aiohttp.TCPConnector(limit=0))
        return session, one_request_sse
    raise ValueError(f"unknown client {kind!r}; choose from {', '.join(CLIENTS)}")


async def run_level(peer: ServerPeer, convs: list[list[dict]], max_tokens: int, concurrency: int | None,
                    rate: float | None, seed: int, prompt_len: list[int],
                    client_kind: str = "aiohttp") -> tuple[list[RequestResult], float, dict | None]:
    """Closed loop at ``concurrency`` clients, or Poisson arrivals at ``rate`` req/s, through the
    ``client_kind`` of :data:`CLIENTS`."""
    client, send = open_client(client_kind, peer)
    sampler = PoolSampler(peer.url) if peer.kvmosaic else None
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop)) if sampler else None
    results: list[RequestResult | None] = [None] * len(convs)

    async def tracked(i: int) -> None:
        if sampler:
            sampler.in_flight[i] = prompt_len[i]
        results[i] = await send(client, peer, convs[i], max_tokens, prompt_len[i])
        if sampler:
            sampler.in_flight.pop(i, None)

    start = time.perf_counter()
    if rate is None:
        queue = list(range(len(convs)))[::-1]

        async def worker() -> None:
            while queue:
                await tracked(queue.pop())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        rng = random.Random(f"{seed}:poisson")
        tasks = []
        for i in range(len(convs)):
            tasks.append(asyncio.create_task(tracked(i)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    stop.set()
    if sampling:
        await sampling
    await client.close()
    return [r for r in results if r is not None], wall, sampler.summary() if sampler else None


async def paired_decode(peer: ServerPeer, convs: list[list[dict]], max_tokens: int, client_kind: str,
                        read: Callable[[], float]) -> list[tuple[float, float]]:
    """For each conversation: ``read()`` (the machine's read bandwidth, GB/s, the server idle), then
    the request alone; its (reading, ITL p50 in seconds). Requests that fail or stream fewer than two
    content chunks are left out."""
    client, send = open_client(client_kind, peer)
    pairs = []
    try:
        for conv in convs:
            gbs = read()
            res = await send(client, peer, conv, max_tokens)
            gaps = inter_token_gaps(res.chunk_times)
            if res.ok and gaps:
                pairs.append((gbs, float(np.median(gaps))))
    finally:
        await client.close()
    return pairs
