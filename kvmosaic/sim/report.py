"""Run the policy x cluster-size grid and write the table (markdown), the figures (JSON) and
plots under ``docs/router/``. Every figure comes from :func:`cluster.simulate`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..router.policies import Oracle, make_policy
from ..router.prompt_hashes import PromptHasher
from .cluster import simulate
from .workload import make_workload

POLICIES = ("round-robin", "least-loaded", "approximate-tree", "cache-aware", "oracle")


def policy_factory(name: str):
    if name == "oracle":
        return lambda index, reps: Oracle(lambda rr, rid: reps[rid].exact_held(rr.hashes))
    return lambda index, reps: make_policy(name, index=index)


def run_one(name: str, n: int, requests_per_replica: int, seed: int = 0) -> dict:
    hasher = PromptHasher.for_model("sim-smollm2-135m", "bfloat16", 16, "xxh3_128")
    reqs = make_workload(n, requests_per_replica, seed=seed)
    t0 = time.perf_counter()
    out = simulate(reqs, n, policy_factory(name), hasher)
    wall = time.perf_counter() - t0
    ttft = np.array([r.first_token - r.arrival for r in reqs])
    prompt = sum(len(r.prompt) for r in reqs)
    span = out["end"] - reqs[0].arrival
    decide = np.array(out["decide_s"]) * 1e6
    reasons = {k: sum(r.reason == k for r in reqs) for k in ("cache_hit", "load_balance", "fallback")}
    return {
        "policy": name, "replicas": n, "requests": len(reqs),
        "hit_rate": sum(r.cached for r in reqs) / prompt,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "throughput_tok_s": (prompt + sum(len(r.output) for r in reqs)) / span,
        "requests_per_s": len(reqs) / span,
        "imbalance_max_over_mean": float(np.mean(out["imbalance"])) if out["imbalance"] else 1.0,
        "decision_us_mean": float(decide.mean()), "decision_us_p99": float(np.percentile(decide, 99)),
        "hashing_us_mean": float(np.mean(out["hash_s"]) * 1e6),
        "utilisation": sum(r.busy_s for r in out["replicas"]) / (n * out["end"]),
        "predicted_over_reported": (sum(r.predicted for r in reqs) / max(1, sum(r.cached for r in reqs))),
        "reasons": reasons, "sim_wall_s": wall,
    }


def table(rows: list[dict]) -> str:
    head = ("| replicas | policy | hit rate | TTFT p50 s | TTFT p99 s | tok/s | imbalance max/mean | "
            "decision µs mean / p99 | utilisation |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['replicas']} | {r['policy']} | {r['hit_rate']:.3f} | {r['ttft_p50_s']:.2f} | "
             f"{r['ttft_p99_s']:.2f} | {r['throughput_tok_s']:,.0f} | {r['imbalance_max_over_mean']:.2f} | "
             f"{r['decision_us_mean']:.0f} / {r['decision_us_p99']:.0f} | {r['utilisation']:.2f} |" for r in rows]
    return head + "\n".join(lines) + "\n"


def targets(rows: list[dict]) -> str:
    get = {(r["policy"], r["replicas"]): r for r in rows}
    out = []
    for n in sorted({r["replicas"] for r in rows}):
        ca, orc, at = get.get(("cache-aware", n)), get.get(("oracle", n)), get.get(("approximate-tree", n))
        if ca and orc:
            out.append(f"- {n} replicas: hit rate cache-aware / oracle = {ca['hit_rate'] / max(orc['hit_rate'], 1e-9):.2f}")
        if ca and at:
            out.append(f"- {n} replicas: TTFT p99 cache-aware / approximate-tree = "
                       f"{ca['ttft_p99_s'] / max(at['ttft_p99_s'], 1e-9):.2f}")
        if ca:
            out.append(f"- {n} replicas: cache-aware decision time {ca['decision_us_mean']:.0f} µs mean, "
                       f"{ca['decision_us_p99']:.0f} µs p99 (+ {ca['hashing_us_mean']:.0f} µs hashing)")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["replicas"] for r in rows})
    paths = []
    for key, label in (("hit_rate", "prefix hit rate"), ("ttft_p99_s", "TTFT p99 (s)"),
                       ("imbalance_max_over_mean", "queued tokens max/mean")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for p in POLICIES:
            ys = [next((r[key] for r in rows if r["policy"] == p and r["replicas"] == n), np.nan) for n in sizes]
            ax.plot(sizes, ys, marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        if key == "ttft_p99_s":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"sim_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def run_grid(sizes: list[int], requests_per_replica: int, out_dir: Path, policies=POLICIES) -> list[dict]:
    rows = []
    for n in sizes:
        for p in policies:
            r = run_one(p, n, requests_per_replica)
            print(f"{n:>4} {p:<17} hit {r['hit_rate']:.3f}  ttft p50 {r['ttft_p50_s']:.2f}s p99 "
                  f"{r['ttft_p99_s']:.2f}s  decision {r['decision_us_mean']:.0f}us  ({r['sim_wall_s']:.0f}s)", flush=True)
            rows.append(r)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sim.json").write_text(json.dumps(rows, indent=1))
    md = ("# Simulated cluster: routing policies x cluster size\n\n"
          "`python -m kvmosaic.sim` (cost model: kvmosaic/sim/cost.py; workload: kvmosaic/sim/workload.py)\n\n"
          + table(rows) + "\n" + targets(rows))
    (out_dir / "sim.md").write_text(md)
    plot(rows, out_dir)
    print("\n" + md)
    return rows
