"""``python -m benchmarks.replicas``: the multi-tenant workload over 2 real replicas on
Ray Serve, once per routing policy. Prints each policy's prefix hit rate (cached / prompt
tokens, as the replicas report them), the cache-aware / round-robin ratio, and the router's
predicted vs reported cached tokens.

The workload is built so that where a request goes matters: ``--tenants`` tenants, each with
a distinct system prompt of about ``--system-tokens`` tokens, ask short questions in a seeded
random order; each replica's pool (``--pool-tenants``) holds about half the tenants' prefixes.
A router that spreads a tenant over both replicas pays its prefix on both and makes each pool
cycle through every tenant (LRU evicts before reuse); one that keeps each tenant on one replica
pays each prefix once.
"""

from __future__ import annotations

import argparse
import re
import time

import httpx

from kvmosaic.bench.tenant_workload import conversations, measure_tokens, pool_blocks, schedule, tenants


def run_policy(policy: str, args, systems: list[str], order: list[int], num_kv_blocks: int) -> dict:
    from kvmosaic.server.launch import ServerProcess

    server = ServerProcess("--replicas", "2", "--router", policy, "--num-kv-blocks", str(num_kv_blocks))
    prompt, cached = 0, 0
    try:
        server.start(timeout=600)
        url, t0 = server.url, time.perf_counter()
        for messages in conversations(systems, order):
            body = {"messages": messages, "max_tokens": 4, "temperature": 0}
            usage = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
        seconds = time.perf_counter() - t0
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        server.stop()

    def metric(name: str) -> float:
        m = re.search(rf"^{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", metrics, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    return {"policy": policy, "hit_rate": cached / prompt, "cached": cached, "prompt": prompt, "seconds": seconds,
            "predicted": metric("kvmosaic_router_predicted_cached_tokens"),
            "reported": metric("kvmosaic_router_reported_cached_tokens")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replicas")
    p.add_argument("--policies", nargs="+", default=["round-robin", "cache-aware", "least-loaded", "approximate-tree"])
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000, help="about this many tokens per system prompt")
    p.add_argument("--pool-tenants", type=float, default=2.5,
                   help="each replica's pool holds this many tenants' prefixes (default: about half of 4, plus room)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override the pool size")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    systems, order = tenants(args.tenants, args.system_tokens, args.seed), schedule(args.requests, args.tenants, args.seed)
    sys_tokens = max(measure_tokens(s) for s in systems)
    blocks = args.num_kv_blocks or pool_blocks(sys_tokens, args.pool_tenants)
    print(f"{args.tenants} tenants, system prompts <= {sys_tokens} tokens, {args.requests} requests "
          f"(tenant order {''.join(map(str, order))}), {blocks} KV blocks per replica", flush=True)
    rows = [run_policy(pol, args, systems, order, blocks) for pol in args.policies]
    print("| policy | prefix hit rate | cached / prompt tokens | router predicted / reported | wall s |\n"
          "|---|---|---|---|---|")
    for r in rows:
        acc = r["predicted"] / r["reported"] if r["reported"] else float("nan")
        print(f"| {r['policy']} | {r['hit_rate']:.3f} | {r['cached']} / {r['prompt']} | "
              f"{r['predicted']:.0f} / {r['reported']:.0f} = {acc:.3f} | {r['seconds']:.1f} |")
    by = {r["policy"]: r for r in rows}
    if "cache-aware" in by and "round-robin" in by and by["round-robin"]["hit_rate"]:
        print(f"\nhit rate cache-aware / round-robin = {by['cache-aware']['hit_rate'] / by['round-robin']['hit_rate']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
