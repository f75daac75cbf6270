"""Storage-tier benchmark: ``python -m benchmarks.tiers`` (issue 11).

Measures, on this machine, with the shipped model:

- TTFT of a prompt whose ``--prefix``-token prefix comes from the host tier, from the disk tier
  after a restart (a new engine on the same directory), and from Redis written by another
  process, each against a cold prefill of the same prompt (``--new`` uncached tokens after it);
- a capacity workload: ``--tenants`` tenants with ``--tenant-prefix``-token system prompts,
  two rounds, a pool sized for ``--pool-tenants`` of them: throughput with a host tier vs pool only;
- no-reuse throughput (distinct prompts) with tiers on (host + disk write-through) vs off.

Prints a markdown table with ratios.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import textwrap
import time

from kvmosaic.engine.llm import LLM
from kvmosaic.engine.sampling_params import SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate([prompt], ONE)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def make(args, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", (args.prefix + args.new) // 16 + 8)
    return LLM(dtype=args.dtype, device="cpu", max_num_batched_tokens=4096, **kw)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--pool-tenants", type=int, default=3)
    ap.add_argument("--tenant-prefix", type=int, default=512)
    ap.add_argument("--distinct", type=int, default=6)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    rows: list[tuple[str, float, float, str]] = []

    def prompt_pair():
        head = tokens(rng, args.prefix)
        return head + tokens(rng, args.new), head + tokens(rng, args.new)

    # Cold prefill (no tiers, empty pool).
    cold_llm = make(args, prefix_cache="hash")
    ttft(cold_llm, tokens(rng, 64))  # warm-up
    first, _ = prompt_pair()
    cold, _ = ttft(cold_llm, first)
    del cold_llm

    # Host tier hit (the pool reset: only the tier has the prefix).
    llm = make(args, kv_tiers=["host:2GiB:write_through"])
    a, b = prompt_pair()
    ttft(llm, a)
    llm.reset_prefix_cache()
    t, hit = ttft(llm, b)
    rows.append(("TTFT host-tier hit / cold prefill", t, cold, f"{hit} cached tokens"))
    llm.engine.close()
    del llm

    # Disk tier hit after restart.
    d = tempfile.mkdtemp(prefix="kvmosaic-bench-disk-")
    a, b = prompt_pair()
    llm = make(args, kv_tiers=[f"disk:{d}:4GiB"])
    ttft(llm, a)
    llm.engine.close()
    del llm
    llm = make(args, kv_tiers=[f"disk:{d}:4GiB"])
    t, hit = ttft(llm, b)
    rows.append(("TTFT disk-tier hit after restart / cold prefill", t, cold, f"{hit} cached tokens"))
    llm.engine.close()
    del llm

    # Redis hit from another process.
    from kvmosaic.tiers.redis_server import RedisServer, find_redis_server

    if find_redis_server() is not None:
        with RedisServer() as server:
            a, b = prompt_pair()
            code = textwrap.dedent(f"""
                from kvmosaic import LLM, SamplingParams
                llm = LLM(dtype={args.dtype!r}, device="cpu", num_kv_blocks={(args.prefix + args.new) // 16 + 8},
                          max_num_batched_tokens=4096, kv_tiers=[{server.url!r}])
                llm.generate([{a!r}], SamplingParams(max_tokens=1, ignore_eos=True))
                llm.engine.close()
            """)
            subprocess.run([sys.executable, "-c", code], check=True)
            llm = make(args, kv_tiers=[server.url])
            t, hit = ttft(llm, b)
            rows.append(("TTFT redis hit from another process / cold prefill", t, cold, f"{hit} cached tokens"))
            llm.engine.close()
            del llm

    # Capacity workload: working set several times the pool.
    tenants = [tokens(rng, args.tenant_prefix) for _ in range(args.tenants)]
    reqs = [p + tokens(rng, args.new) for _ in range(2) for p in tenants]
    per = -(-(args.tenant_prefix + args.new + 1) // 16)
    blocks = per * args.pool_tenants + 2

    def throughput(**kw) -> tuple[float, int]:
        llm = LLM(dtype=args.dtype, device="cpu", num_kv_blocks=blocks, max_num_seqs=1, **kw)
        t0 = time.perf_counter()
        outs = [llm.generate([r], ONE)[0] for r in reqs]
        dt = time.perf_counter() - t0
        if llm.engine.tiers is not None:
            llm.engine.close()
        return len(reqs) / dt, sum(o.num_cached_tokens for o in outs)

    on, on_hit = throughput(kv_tiers=["host:2GiB"])
    off, off_hit = throughput()
    rows.append(("capacity workload req/s, host tier / pool only", on, off,
                 f"cached tokens {on_hit} vs {off_hit}; {args.tenants} tenants, pool for {args.pool_tenants}"))

    # No reuse: tiers only cost (copies out), never help.
    distinct = [tokens(rng, args.tenant_prefix) for _ in range(args.distinct)]
    d2 = tempfile.mkdtemp(prefix="kvmosaic-bench-noreuse-")

    def plain(**kw) -> float:
        llm = LLM(dtype=args.dtype, device="cpu", num_kv_blocks=blocks, **kw)
        t0 = time.perf_counter()
        llm.generate(distinct, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        dt = time.perf_counter() - t0
        if llm.engine.tiers is not None:
            llm.engine.close()
        return len(distinct) / dt

    t_on = plain(kv_tiers=["host:2GiB:write_through", f"disk:{d2}:4GiB"])
    t_off = plain()
    rows.append(("no-reuse req/s, tiers on (host+disk write-through) / off", t_on, t_off, ""))

    print(f"\nprefix {args.prefix} tokens + {args.new} new, dtype {args.dtype}; cold prefill TTFT {cold:.3f} s\n")
    print("| measure | value | baseline | ratio | note |")
    print("|---|---|---|---|---|")
    for name, v, base, note in rows:
        print(f"| {name} | {v:.4g} | {base:.4g} | {v / base:.3f} | {note} |")


if __name__ == "__main__":
    main()
