"""What priority scheduling buys the urgent requests of an overloaded engine, and what it costs the
rest: ``python -m benchmarks.priority_latency``.

In one process, the same open-loop workload twice, ``scheduling_policy`` fcfs then priority (and
again, alternated, ``--rounds`` times): ``--requests`` prompts of random token ids arrive at
``--rate`` per second (Poisson, seeded), more than the engine serves, so a queue builds; every
``--urgent-every``-th request has priority 1, the others 0. Each request's TTFT runs from the moment
it was due (its arrival) to its first token; the table gives the urgent and the other requests'
medians and 90th percentiles, the whole run's wall time and the preemptions. Run it on a quiet
machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvmosaic import LLM, SamplingParams
from kvmosaic.bench.machine import describe


def workload(args) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt token ids, priority) per request, in arrival order."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        out.append((t, [rng.randrange(100, 40000) for _ in range(args.tokens)], int(i % args.urgent_every == 0)))
    return out


def run(llm: LLM, policy: str, reqs, max_tokens: int) -> dict:
    engine = llm.engine
    engine.scheduler.config.policy = policy
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    preempted = engine.get_stats().num_preemptions
    due, first, pending = {}, {}, list(enumerate(reqs))
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][1][0] <= now:
            i, (offset, ids, priority) = pending.pop(0)
            engine.add_request({"prompt_token_ids": ids}, params, request_id=f"{policy}-{i}", priority=priority)
            due[i] = start + offset
        if not engine.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, pending[0][1][0] - now)))
            continue
        for out in engine.step():
            i = int(out.request_id.rsplit("-", 1)[1])
            if out.token_ids and i not in first:
                first[i] = time.perf_counter()
    wall = time.perf_counter() - start
    ttft = {i: first[i] - due[i] for i in first}
    urgent = [ttft[i] for i, r in enumerate(reqs) if r[2]]
    other = [ttft[i] for i, r in enumerate(reqs) if not r[2]]
    return {"urgent": urgent, "other": other, "wall": wall,
            "preemptions": engine.get_stats().num_preemptions - preempted}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.priority_latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=6.0, help="arrivals per second")
    p.add_argument("--tokens", type=int, default=200, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--urgent-every", type=int, default=6)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(describe())
    llm = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    reqs = workload(args)
    results: dict[str, list[dict]] = {"fcfs": [], "priority": []}
    for r in range(args.rounds):
        for policy in (("fcfs", "priority") if r % 2 == 0 else ("priority", "fcfs")):
            results[policy].append(run(llm, policy, reqs, args.max_tokens))
    print(f"\n{args.dtype}, {args.requests} requests of {args.tokens} + {args.max_tokens} tokens at {args.rate}/s "
          f"(1 in {args.urgent_every} urgent), max_num_seqs {args.max_num_seqs}, {args.rounds} rounds alternated")
    print("| policy | urgent TTFT p50 / p90 s | other TTFT p50 / p90 s | wall s | preemptions |\n|---|---|---|---|---|")
    for policy, runs in results.items():
        urgent = [x for r in runs for x in r["urgent"]]
        other = [x for r in runs for x in r["other"]]
        print(f"| {policy} | {statistics.median(urgent):.2f} / {pct(urgent, 0.9):.2f} | {statistics.median(other):.2f} / "
              f"{pct(other, 0.9):.2f} | {statistics.median(r['wall'] for r in runs):.1f} | "
              f"{sum(r['preemptions'] for r in runs) / len(runs):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
