"""The cost of the prefix cache when nothing hits, with its spread: ``python -m benchmarks.cache_cost``.

Runs the no-reuse workload ``--rounds`` times on kvmosaic with the cache on (``--cache``, default
hash) and off (none), each in its own worker, requests interleaved (on, off; then off, on, ...) and
caches reset every round. Reports, over rounds, the throughput ratio on/off (median, interquartile
range, min/max) and, over all requests, the paired end-to-end ratio (each pair ran back to back).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from kvmosaic.bench.peers import PeerSettings
from kvmosaic.bench.runner import run_workload, warm_up
from kvmosaic.bench.worker import PeerProcess
from kvmosaic.bench.workloads import build
from kvmosaic.server.tokenizer import tokenizer_for


def spread(values: list[float]) -> dict:
    v = np.asarray(values, dtype=float)
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {"n": len(v), "median": float(med), "q1": float(q1), "q3": float(q3), "min": float(v.min()), "max": float(v.max()),
            "iqr_half_pct": float((q3 - q1) / 2 / med * 100)}


def fmt(s: dict) -> str:
    return (f"{s['median']:.3f} (IQR {s['q1']:.3f}-{s['q3']:.3f}, ±{s['iqr_half_pct']:.1f}%; "
            f"min {s['min']:.3f}, max {s['max']:.3f}; n={s['n']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cache", default="hash", choices=["hash", "radix"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)
    on, off = f"kvmosaic-{args.cache}", "kvmosaic-none"
    settings = PeerSettings(dtype=args.dtype, threads=args.threads)
    tokenizer = tokenizer_for(None)
    workload = build("no-reuse", 0, args.quick)
    peers = {n: PeerProcess(n, settings) for n in (on, off)}
    started = time.time()
    try:
        for proc in peers.values():
            proc.wait_ready()
        warm_up(peers, tokenizer)
        round_ratios, paired = [], []
        for r in range(args.rounds):
            order = dict(list(peers.items())[:: 1 if r % 2 == 0 else -1])  # alternate who goes first
            run = run_workload(workload, order, tokenizer)
            tps = {}
            for name in peers:
                recs = [x for x in run.records if x.peer == name]
                tps[name] = sum(x.prompt_tokens + x.generated_tokens for x in recs) / sum(x.e2e for x in recs)
            round_ratios.append(tps[on] / tps[off])
            e2e = {(x.peer, x.index): x.e2e for x in run.records}
            paired += [e2e[(off, i)] / e2e[(on, i)] for i in range(len(workload.requests))]
            print(f"round {r + 1}: {on} {tps[on]:.0f} tok/s, {off} {tps[off]:.0f} tok/s, ratio {round_ratios[-1]:.3f}", flush=True)
    finally:
        for proc in peers.values():
            proc.stop()
    result = {"rounds": spread(round_ratios), "paired_requests": spread(paired), "raw_round_ratios": round_ratios,
              "command": f"python -m benchmarks.cache_cost --rounds {args.rounds} --cache {args.cache} --dtype {args.dtype}"
                         + (" --quick" if args.quick else ""),
              "wall_s": time.time() - started, "requests_per_round": len(workload.requests)}
    md = (f"- command: `{result['command']}` ({result['wall_s']:.0f} s)\n"
          f"- no-reuse throughput, cache {args.cache} / none, per round: {fmt(result['rounds'])}\n"
          f"- paired per-request speed (none e2e / {args.cache} e2e), all requests: {fmt(result['paired_requests'])}\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache_cost.md").write_text(md)
    (out / "cache_cost.json").write_text(json.dumps(result, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
