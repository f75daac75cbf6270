"""``python -m kvmosaic.bench.fairness``: does one tenant's flood hold back another?

One ``kvmosaic serve`` with two API keys. Tenant B sends short requests one at a time
(``--b-requests``); its TTFT p50 is measured (1) alone, before and after the rest, (2) while tenant A keeps ``--flood``
requests of ``--flood-tokens``-token distinct prompts in flight, and (3) the same flood with
B's requests sent under A's key, i.e. as one more of A's requests: what B would see without
fair share between tenants (engine/fair_share.py). Prints the three p50s and the ratios
(target: (2) / (1) <= 2, issue 25). Streaming, temperature 0; prompts seeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

WORDS = "apple river stone cloud engine paper garden silver window market candle forest".split()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def ttft(client: httpx.AsyncClient, key: str, text: str, max_tokens: int) -> float | None:
    """Seconds to the first content chunk of one streamed completion (None: it failed)."""
    t0 = time.perf_counter()
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            return None
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - t0
        return first


async def b_series(client, key: str, n: int, rng: random.Random, think: float = 0.0) -> list[float]:
    """B's TTFTs, one request at a time; between them B waits 0 to ``think`` seconds (uniform)."""
    out = []
    for i in range(n):
        if think and i:
            await asyncio.sleep(rng.uniform(0, think))
        t = await ttft(client, key, f"Question {i}: " + prompt(rng, 60), 4)
        if t is not None:
            out.append(t)
    return out


async def flood(client, n: int, words: int, rng: random.Random, stop: asyncio.Event, done: list[float]) -> None:
    """Keep ``n`` of A's long requests in flight until ``stop``; ``done`` gets the time each
    one finished (A's throughput)."""
    async def one(i: int) -> None:
        while not stop.is_set():
            try:
                if await ttft(client, "key-a", f"Flood {i} {rng.random()}: " + prompt(rng, words), 16) is not None:
                    done.append(time.perf_counter())
            except httpx.HTTPError:
                pass

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def under_flood(url: str, args, b_key: str, seed: int) -> tuple[list[float], float]:
    """B's TTFTs beside A's flood, and A's requests finished per second while B's ran."""
    rng = random.Random(seed)
    stop = asyncio.Event()
    done: list[float] = []
    limits = httpx.Limits(max_connections=args.flood + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        flooding = asyncio.create_task(flood(client, args.flood, int(args.flood_tokens / 1.2), rng, stop, done))
        await asyncio.sleep(args.warmup)  # the flood fills the running slots and the queue
        t0 = time.perf_counter()
        got = await b_series(client, b_key, args.b_requests, rng, args.b_think_ms / 1e3)
        t1 = time.perf_counter()
        stop.set()
        await flooding
    return got, sum(t0 <= t <= t1 for t in done) / (t1 - t0)


def anticipation(url: str) -> str:
    """The server's anticipation counters so far, from /metrics."""
    text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer key-admin"}, timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("kvmosaic:fair_share_anticipation_"):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name.removeprefix("kvmosaic:fair_share_anticipation_").removesuffix("_total")] = value
    return (f"{values.get('holds', 0):.0f} holds, {values.get('hits', 0):.0f} came back inside, "
            f"{values.get('held_seconds', 0) * 1e3:,.0f} ms held")


def main(argv: list[str] | None = None) -> int:
    from kvmosaic.server.launch import ServerProcess

    from .machine import describe

    p = argparse.ArgumentParser(prog="python -m kvmosaic.bench.fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--flood", type=int, default=64, help="A's requests in flight")
    p.add_argument("--flood-tokens", type=int, default=1500, help="tokens per A prompt")
    p.add_argument("--b-requests", type=int, default=6)
    p.add_argument("--b-think-ms", type=float, default=0.0,
                   help="B waits 0 to this many ms (uniform) before each next request (0: at once, closed loop)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of flood before B starts")
    p.add_argument("--serve-args", default="", help="more 'kvmosaic serve' flags")
    p.add_argument("--no-baseline", action="store_true", help="skip B's requests sent as A's (minutes)")
    args = p.parse_args(argv)
    print(f"machine: {describe()}")
    flags = ["--dtype", args.dtype, "--api-key", "key-a", "--api-key", "key-b", "--admin-key", "key-admin",
             *args.serve_args.split()]
    with ServerProcess(*flags) as server:
        async def alone() -> list[float]:
            async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
                await b_series(client, "key-b", 2, random.Random(9))  # warm up
                return await b_series(client, "key-b", args.b_requests, random.Random(1), args.b_think_ms / 1e3)

        solo = asyncio.run(alone())
        fair, a_rate = asyncio.run(under_flood(server.url, args, "key-b", 2))
        held = anticipation(server.url)
        solo += asyncio.run(alone())  # before and after: B alone is not one lucky (or slow) series
        as_a = [] if args.no_baseline else asyncio.run(under_flood(server.url, args, "key-a", 3))[0]
    rows = [("B alone", solo), ("B beside A's flood", fair), ("B's requests as A's (no fair share)", as_a)]
    print(f"\nflood: {args.flood} x {args.flood_tokens}-token prompts from key A; B: {args.b_requests} requests "
          f"one at a time (think time 0-{args.b_think_ms:g} ms), ~70-token prompts, dtype {args.dtype}\n")
    print("| B's requests | TTFT p50 ms | n |\n|---|---|---|")
    for name, xs in rows:
        print(f"| {name} | {statistics.median(xs) * 1e3:,.0f} | {len(xs)} |" if xs else f"| {name} | failed | 0 |")
    print(f"\nA's requests finished per second while B's ran beside them: {a_rate:.2f}")
    print(f"anticipation (engine/anticipation.py) after the flood: {held}")
    if solo and fair:
        print(f"\nbeside the flood / alone: {statistics.median(fair) / statistics.median(solo):.2f}x (target <= 2)")
    if fair and as_a:
        print(f"without fair share / with: {statistics.median(as_a) / statistics.median(fair):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
