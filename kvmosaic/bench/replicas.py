"""``python -m kvmosaic.bench.replicas``: the multi-tenant workload over 2 real replicas on
Ray Serve, once per routing policy. Prints each policy's prefix hit rate (cached / prompt
tokens, as the replicas report them), the cache-aware / round-robin ratio, and the router's
predicted vs reported cached tokens.
"""

from __future__ import annotations

import argparse
import re

import httpx


def tenants(n: int) -> list[str]:
    return [f"You are the assistant of tenant {t}. Follow policy number {t} and answer briefly. " * 14
            for t in range(n)]


def run_policy(policy: str, args) -> dict:
    import ray
    from ray import serve

    from ..serve.app import build_app
    from ..server.launch import free_port

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(2, policy, {"num_kv_blocks": args.num_kv_blocks}), name="kvmosaic", route_prefix="/")
    url, systems, prompt, cached = f"http://127.0.0.1:{port}", tenants(args.tenants), 0, 0
    try:
        for i in range(args.requests):
            t = i % args.tenants
            body = {"messages": [{"role": "system", "content": systems[t]},
                                 {"role": "user", "content": f"Question {i}: what is {i} + {t}?"}],
                    "max_tokens": 4, "temperature": 0}
            usage = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        serve.shutdown()
        ray.shutdown()

    def metric(name: str) -> float:
        m = re.search(rf"^{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", metrics, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    return {"policy": policy, "hit_rate": cached / prompt, "cached": cached, "prompt": prompt,
            "predicted": metric("kvmosaic_router_predicted_cached_tokens"),
            "reported": metric("kvmosaic_router_reported_cached_tokens")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmosaic.bench.replicas")
    p.add_argument("--policies", nargs="+", default=["round-robin", "cache-aware", "least-loaded", "approximate-tree"])
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--num-kv-blocks", type=int, default=256, help="small pools: 2 replicas cannot hold every tenant")
    args = p.parse_args(argv)
    rows = [run_policy(pol, args) for pol in args.policies]
    print("| policy | prefix hit rate | cached / prompt tokens | router predicted / reported |\n|---|---|---|---|")
    for r in rows:
        acc = r["predicted"] / r["reported"] if r["reported"] else float("nan")
        print(f"| {r['policy']} | {r['hit_rate']:.3f} | {r['cached']} / {r['prompt']} | "
              f"{r['predicted']:.0f} / {r['reported']:.0f} = {acc:.3f} |")
    by = {r["policy"]: r for r in rows}
    if "cache-aware" in by and "round-robin" in by and by["round-robin"]["hit_rate"]:
        print(f"\nhit rate cache-aware / round-robin = {by['cache-aware']['hit_rate'] / by['round-robin']['hit_rate']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
