"""A fresh server's first request against the ones after it: ``python -m benchmarks.first_request``.

Starts ``kvmosaic serve`` (``--servers`` times, each fresh, with the engine flags given after
``--``), and on one kept-open connection sends ``--requests`` streamed one-token completions of
a few tokens each; prints each server's first TTFT beside the median of the rest. What the first
pays beyond them is what the process builds once (oneDNN's primitives, the kernels' first calls),
which the engine's warm-up at start-up (``ModelRunner.warm_up``) moves before the server listens.
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from kvmosaic.bench.machine import describe
from kvmosaic.bench.sse import content_deltas
from kvmosaic.server.launch import ServerProcess


def ttfts(url: str, requests: int) -> list[float]:
    """Seconds to the first content chunk of each streamed one-token request, in order."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(requests):
            t0 = time.perf_counter()
            times = [t for t, _ in content_deltas(client, "/v1/completions",
                                                 {"prompt": f"Hi {i}", "max_tokens": 1, "temperature": 0})]
            out.append((times[0] if times else time.perf_counter()) - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_request", description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("serve_args", nargs="*", help="kvmosaic serve flags, after --")
    args = p.parse_args(argv)
    print(describe())
    print("| server | first TTFT ms | later TTFT p50 ms | first - later ms |\n|---|---|---|---|")
    for s in range(args.servers):
        with ServerProcess(*args.serve_args) as proc:
            times = ttfts(proc.url, args.requests)
        later = statistics.median(times[1:])
        print(f"| {s + 1} | {times[0] * 1e3:.0f} | {later * 1e3:.0f} | {(times[0] - later) * 1e3:+.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
