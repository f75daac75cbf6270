"""A prefill when another process holds a core: quiet against contended, thread budget on and off.

Issue 26 measured a ~650-token bfloat16 prefill at 0.40 s on a quiet 2-core machine and 3.8-5.0 s
with one other busy process: every OpenMP region waits for the thread that shares its core.
This runs the same prefill (cache off, so every repetition computes it) in four conditions, in
one process, on the dtype ``auto`` picks (or ``--dtype``):

* quiet / contended: with no other work, and beside ``--busy`` processes that spin on the CPU;
* budget on / off: ``adaptive_threads`` (engine/threads.py) against all threads always.

Prints the median of ``--repeats`` prefills per condition and each contended / quiet ratio
(issue 26's target: <= 2x). Run: ``python -m benchmarks.contention`` from the repository root.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time

from kvmosaic.bench.machine import describe
from kvmosaic.engine import LLM, SamplingParams

SPIN = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass\n"


def prefill_seconds(llm: LLM, tokens: int, repeats: int, seed: int) -> float:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for _ in range(repeats + 1):
        prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first one warms up


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=650)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--busy", type=int, default=1, help="spinning processes beside the engine when contended")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="the engine's threads (default: torch's)")
    args = p.parse_args(argv)

    engines = {adaptive: LLM(dtype=args.dtype, enable_prefix_caching=False, adaptive_threads=adaptive,
                             num_threads=args.threads) for adaptive in (True, False)}
    print(describe())
    print(f"dtype {engines[True].dtype}, {args.tokens}-token prefill, median of {args.repeats}, "
          f"{args.busy} busy process(es) when contended")
    results: dict[tuple[bool, bool], float] = {}
    for contended in (False, True):
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy if contended else 0)]
        try:
            time.sleep(0.5 if spinners else 0)
            for adaptive, llm in engines.items():
                results[(adaptive, contended)] = prefill_seconds(llm, args.tokens, args.repeats, seed=len(results))
        finally:
            for proc in spinners:
                proc.kill()
                proc.wait()
    print("| thread budget | quiet s | contended s | contended / quiet |")
    print("|---|---|---|---|")
    for adaptive in (True, False):
        quiet, busy = results[(adaptive, False)], results[(adaptive, True)]
        print(f"| {'on' if adaptive else 'off'} | {quiet:.3f} | {busy:.3f} | {busy / quiet:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
