"""A served stream beside a process that is busy in bursts: how long the stream's tokens wait.

``benchmarks.contention`` measures a prefill beside a process that spins all the time; the thread
budget (``engine/threads.py``) gives that core up within half a second. A neighbour busy for
a fraction of a second at a time is another matter: a decode step runs its OpenMP team on both
cores, and while the neighbour holds one of them every barrier of the step waits for the thread
descheduled there. This starts ``kvmosaic serve`` (its own process, the environment of this one:
set ``GOMP_SPINCOUNT`` here to try the OpenMP runtime's spin count), streams 200-token completions
one after another for ``--seconds``, and runs beside them a process busy ``--busy`` seconds then idle
``--idle`` seconds (``--busy 0``: a quiet machine). Prints the gaps between the stream's chunks.

Run: ``python -m benchmarks.bursty_neighbour`` from the repository root (``--busy``, ``--idle``,
``--seconds``, ``--dtype``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import httpx

from kvmosaic.bench.machine import describe
from kvmosaic.server.launch import ServerProcess

STREAM = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 200, "ignore_eos": True, "stream": True}


def neighbour(stop, busy: float, idle: float) -> None:
    """Busy ``busy`` seconds (a spinning loop), then asleep ``idle`` seconds, until ``stop``."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(idle)


def stream_gaps(url: str, seconds: float) -> list[float]:
    """Seconds between consecutive chunks of each stream, streams back to back for ``seconds``."""
    gaps: list[float] = []
    with httpx.Client(timeout=60) as client:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            last = None
            with client.stream("POST", url + "/v1/completions", json=STREAM) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=float, default=0.3, help="seconds the neighbour spins (0: no neighbour)")
    ap.add_argument("--idle", type=float, default=0.7, help="seconds it sleeps between bursts")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the stream runs")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    print(describe(), f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(default)')}", flush=True)
    with ServerProcess("--dtype", args.dtype) as proc:
        httpx.post(proc.url + "/v1/completions", json={**STREAM, "stream": False, "max_tokens": 4}, timeout=60)
        stop = mp.Event()
        other = mp.Process(target=neighbour, args=(stop, args.busy, args.idle)) if args.busy > 0 else None
        if other is not None:
            other.start()
        try:
            gaps = sorted(stream_gaps(proc.url, args.seconds))
        finally:
            stop.set()
            if other is not None:
                other.join()
    print(f"neighbour busy {args.busy} s / idle {args.idle} s: {len(gaps)} gaps, p50 {gaps[len(gaps) // 2] * 1e3:.1f} ms, "
          f"p99 {gaps[int(len(gaps) * 0.99)] * 1e3:.1f} ms, max {gaps[-1] * 1e3:.0f} ms, "
          f"mean {statistics.mean(gaps) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
