"""What the replicas' front costs a streamed answer (issue 20): ``python -m benchmarks.front_ttft``.

Starts, one after another, one ``kvmosaic serve`` and ``kvmosaic serve --replicas 1`` with the
same engine flags (``--replica-cpus`` = the single server's threads), with Ray Serve's direct
ingress (the default) and through Ray's HTTP proxy (``--no-direct-ingress``); sends each
``--requests`` streamed completions one at a time (a shared ~700-token system prompt, a distinct
question, ``--max-tokens``, temperature 0) and prints the TTFT p50 / p90 of each and the
front's p50 cost over the single server (target: <= +20 ms). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from kvmosaic.bench.machine import describe
from kvmosaic.bench.sse import content_deltas
from kvmosaic.server.launch import ServerProcess

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 60


def ttfts(url: str, requests: int, max_tokens: int, warmup: int = 3) -> list[float]:
    """Seconds to the first content chunk of each streamed request, after ``warmup`` unmeasured."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(requests + warmup):
            body = {"prompt": SYSTEM + f"Question {i}?", "max_tokens": max_tokens, "temperature": 0}
            t0 = time.perf_counter()
            times = [t for t, _ in content_deltas(client, "/v1/completions", body)]
            if i >= warmup and times:
                out.append(times[0] - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.front_ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    engine = ["--dtype", args.dtype, "--num-kv-blocks", "512", "--num-threads", str(args.threads)]
    front = [*engine, "--replicas", "1", "--replica-cpus", str(args.threads)]
    configs = {"one server": engine, "--replicas 1, direct ingress": front,
               "--replicas 1, Ray's proxy": [*front, "--no-direct-ingress"]}
    print(f"machine: {describe()}\n")
    print("| configuration | TTFT p50 ms | TTFT p90 ms | vs one server |\n|---|---|---|---|")
    base = None
    for name, flags in configs.items():
        with ServerProcess(*flags) as server:
            xs = sorted(ttfts(server.url, args.requests, args.max_tokens))
        p50 = statistics.median(xs)
        base = p50 if base is None else base
        delta = "" if p50 is base else f"{(p50 - base) * 1e3:+.1f} ms"
        print(f"| {name} | {p50 * 1e3:.1f} | {xs[int(0.9 * (len(xs) - 1))] * 1e3:.1f} | {delta} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
