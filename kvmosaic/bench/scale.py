"""``kvmosaic bench scale`` (or ``python -m kvmosaic.bench.scale``): one server against two
replicas on the same cores, in one run, same dtype and model.

Configurations (each ``kvmosaic serve`` as a child process, started one at a time):

- ``single``: one engine process, ``--num-threads CORES``;
- ``2x cache-aware`` / ``2x round-robin``: ``--replicas 2 --router POLICY``, one torch thread per
  replica (``--num-threads 1``; each reserves ``CORES / 2`` Ray CPUs: the front reserves none);
- ``1x front``: ``--replicas 1`` with the single server's engine flags, shared-prefix at
  concurrency 1 only: the cost of the Ray Serve front (TTFT p50 minus the single server's).

The single server (and ``1x front``) gets as many KV blocks as the two replicas together.
Workloads: ``shared-prefix`` (:mod:`.serve_workloads`: one long system prompt, short distinct
questions) and ``multi-tenant`` (:mod:`.tenant_workload`: ``--tenants`` distinct system prompts in a seeded
random order, each replica's pool holding about ``--pool-tenants`` of them). Every (workload,
concurrency) has prompts of its own; every configuration gets the same prompts.

Measured per (configuration, workload, closed-loop concurrency), by the streaming client of
:mod:`.serve_client`: TTFT p50/p99, output tok/s over the level's wall time, and the prefix hit
rate (usage cached_tokens / prompt_tokens). Ratios: replicas' output tok/s / the single server's,
and cache-aware / round-robin hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from . import tenant_workload
from .machine import describe
from .serve_client import run_level
from .serve_report import LevelResult, format_ms, load_label, summarize_level
from .serve_workloads import FULL, QUICK, ServeSizes, serve_requests

SINGLE, CACHE_AWARE, ROUND_ROBIN, FRONT = "single", "2x cache-aware", "2x round-robin", "1x front"


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bench scale (workload 'scale'; also --concurrency (default 1,4), --requests (16, quick 4), "
                             "--max-tokens (16, quick 4), --kvmosaic-args)")
    g.add_argument("--cores", type=int, default=2, help="cores in every configuration (single: its threads)")
    g.add_argument("--tenants", type=int, default=4, help="multi-tenant: tenants (distinct system prompts)")
    g.add_argument("--system-tokens", type=int, default=None, help="multi-tenant: tokens per system prompt (1000, quick 120)")
    g.add_argument("--pool-tenants", type=float, default=2.5, help="multi-tenant: a replica's pool holds this many tenants")


def configs(cores: int, dtype: str, blocks: int, extra: list[str]) -> dict[str, list[str]]:
    """``kvmosaic serve`` flags per configuration; ``blocks`` is one replica's KV pool."""
    engine = ["--dtype", dtype, *extra]
    single = [*engine, "--num-threads", str(cores), "--num-kv-blocks", str(2 * blocks)]
    pair = [*engine, "--replicas", "2", "--replica-cpus", f"{cores / 2:g}", "--num-threads", str(max(1, cores // 2)),
            "--num-kv-blocks", str(blocks)]
    return {SINGLE: single, CACHE_AWARE: [*pair, "--router", "cache-aware"], ROUND_ROBIN: [*pair, "--router", "round-robin"],
            FRONT: [*single, "--replicas", "1", "--replica-cpus", str(cores)]}


def hit_rate(r: LevelResult) -> float | None:
    return r.cached_tokens / r.prompt_tokens if r.prompt_tokens else None


def ratios(rows: list[LevelResult]) -> list[str]:
    """The summary lines: front overhead, replicas vs single tok/s, cache-aware / round-robin hits."""
    by = {(r.peer, r.workload, r.level): r for r in rows}
    lines = []
    front, single = by.get((FRONT, "shared-prefix", 1)), by.get((SINGLE, "shared-prefix", 1))
    if front and single and front.ttft_p50 is not None and single.ttft_p50 is not None:
        lines.append(f"front overhead (shared-prefix c=1, TTFT p50 {FRONT} - {SINGLE}): "
                     f"{(front.ttft_p50 - single.ttft_p50) * 1e3:+.1f} ms")
    for (peer, wl, level), r in by.items():
        base = by.get((SINGLE, wl, level))
        if peer in (CACHE_AWARE, ROUND_ROBIN) and base and base.output_tps:
            lines.append(f"{wl} c={int(level)}: {peer} / {SINGLE} output tok/s = {r.output_tps / base.output_tps:.2f}")
    for (peer, wl, level), r in by.items():
        rr = by.get((ROUND_ROBIN, wl, level))
        if peer == CACHE_AWARE and rr:
            lines.append(f"{wl} c={int(level)}: hit rate {hit_ratio(hit_rate(r), hit_rate(rr))}")
    mt = [pooled_hit_rate(rows, p, "multi-tenant") for p in (CACHE_AWARE, ROUND_ROBIN)]
    if None not in mt:
        lines.append(f"multi-tenant, all levels: hit rate {hit_ratio(*mt)}")
    return lines


def pooled_hit_rate(rows: list[LevelResult], peer: str, workload: str) -> float | None:
    """Cached / prompt tokens over every level of one configuration and workload."""
    sel = [r for r in rows if r.peer == peer and r.workload == workload]
    prompt = sum(r.prompt_tokens for r in sel)
    return sum(r.cached_tokens for r in sel) / prompt if prompt else None


def hit_ratio(ca: float | None, rr: float | None) -> str:
    if ca is None or rr is None:
        return "n/a"
    return f"{CACHE_AWARE} / {ROUND_ROBIN} = {ca:.3f} / {rr:.3f} = " + (f"{ca / rr:.2f}" if rr else "n/a (round-robin 0)")


def table(rows: list[LevelResult]) -> str:
    lines = ["| workload | configuration | load | reqs | TTFT p50 ms | TTFT p99 ms | output tok/s | prefix hit rate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hr = hit_rate(r)
        lines.append(f"| {r.workload} | {r.peer} | {load_label(r)} | {r.requests}{f' ({r.failed} failed)' if r.failed else ''} "
                     f"| {format_ms(r.ttft_p50)} | {format_ms(r.ttft_p99)} | {r.output_tps:.1f} | "
                     f"{'–' if hr is None else f'{hr:.3f}'} |")
    return "\n".join(lines)


def plan(args: argparse.Namespace, sizes: ServeSizes, system_tokens: int) -> list[tuple[str, int, list[list[dict]]]]:
    """(workload, concurrency, chat requests), each pair with prompts of its own."""
    out = []
    for c in sizes.concurrency:
        n = max(sizes.requests, c)
        out.append(("shared-prefix", c, serve_requests("shared-prefix", n, sizes, args.seed, f"scale-c{c}")))
        systems = [f"[c={c}] {s}" for s in tenant_workload.tenants(args.tenants, system_tokens, args.seed + c)]
        out.append(("multi-tenant", c, tenant_workload.conversations(systems, tenant_workload.schedule(n, args.tenants, args.seed))))
    return out


def run_config(name: str, flags: list[str], work, max_tokens: int, seed: int) -> list[LevelResult]:
    import httpx

    from ..server.launch import ServerProcess

    t0, server = time.perf_counter(), ServerProcess(*flags)
    print(f"starting {name}: kvmosaic serve {' '.join(flags)}", flush=True)
    try:
        server.start(timeout=600)
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        peer = SimpleNamespace(name=name, url=server.url, model=model, extra_body={"ignore_eos": True},
                               usage_option=True, kvmosaic=False)
        print(f"  ready after {time.perf_counter() - t0:.0f} s", flush=True)
        warmup = [[{"role": "user", "content": f"Warm-up {i}: say hello."}] for i in range(4)]  # both replicas
        warm, _, _ = asyncio.run(run_level(peer, warmup, 2, 2, None, seed, [0] * 4))
        if not all(w.ok for w in warm):
            raise RuntimeError(f"warm-up failed: {[w.error for w in warm]}")
        rows = []
        for wl, c, convs in work:
            res, wall, _ = asyncio.run(run_level(peer, convs, max_tokens, c, None, seed, [0] * len(convs)))
            rows.append(summarize_level(name, wl, "closed", c, res, wall))
            r = rows[-1]
            print(f"  {wl} c={c}: {r.requests} ok, {r.failed} failed, TTFT p50 {format_ms(r.ttft_p50)} ms, "
                  f"{r.output_tps:.1f} out tok/s, hit rate {hit_rate(r) or 0:.3f}" + (f"; {r.errors}" if r.errors else ""), flush=True)
        return rows
    finally:
        server.stop()
        print(f"  {name}: {time.perf_counter() - t0:.0f} s with start and stop", flush=True)


def run(args: argparse.Namespace) -> int:
    import shlex

    base = QUICK if args.quick else FULL
    sizes = ServeSizes(system_words=base.system_words, max_tokens=args.max_tokens or (4 if args.quick else 16),
                       requests=args.requests or (4 if args.quick else 16),
                       concurrency=tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else (1, 4))
    system_tokens = args.system_tokens or (120 if args.quick else 1000)
    sys_tok = max(tenant_workload.measure_tokens(s) for s in tenant_workload.tenants(args.tenants, system_tokens, args.seed))
    blocks = tenant_workload.pool_blocks(sys_tok, args.pool_tenants)
    work = plan(args, sizes, system_tokens)
    started = time.time()
    print(f"machine: {describe()}", flush=True)
    setup = (f"dtype {args.dtype}, {args.cores} cores; {sizes.requests} requests per level (closed loop, "
             f"c={','.join(map(str, sizes.concurrency))}), {sizes.max_tokens} output tokens; shared-prefix system prompt "
             f"{sizes.system_words} words; multi-tenant: {args.tenants} tenants of <= {sys_tok} tokens, {blocks} KV blocks "
             f"per replica ({2 * blocks} for {SINGLE} and {FRONT})")
    print(setup, flush=True)
    rows: list[LevelResult] = []
    for name, flags in configs(args.cores, args.dtype, blocks, shlex.split(args.kvmosaic_args)).items():
        todo = [w for w in work if w[0] == "shared-prefix" and w[1] == 1] if name == FRONT else work
        try:
            rows += run_config(name, flags, todo, sizes.max_tokens, args.seed)
        except (RuntimeError, TimeoutError, OSError) as err:
            print(f"{name} could not run: {str(err)[-600:]}", flush=True)
    order = {n: i for i, n in enumerate(configs(1, "", 0, []))}
    rows.sort(key=lambda r: (r.workload != "shared-prefix", r.level, order[r.peer]))
    summary = ratios(rows)
    md = "\n".join([f"# kvmosaic bench scale\n\n- machine: {describe()}\n- {setup}\n"
                     f"- wall time: {time.time() - started:.0f} s (server starts included)\n",
                     table(rows), "", *[f"- {line}" for line in summary], ""])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.md").write_text(md)
    (out / "scale.json").write_text(json.dumps({"rows": [asdict(r) for r in rows], "summary": summary}, indent=1))
    print("\n" + md + f"\nwrote {out}/scale.md, scale.json", flush=True)
    return 0 if rows else 1


def main(argv: list[str] | None = None) -> int:
    from .serving import add_serve_arguments

    p = argparse.ArgumentParser(prog="python -m kvmosaic.bench.scale", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default bfloat16 (quick: float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results")
    add_serve_arguments(p)
    add_scale_arguments(p)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.quick else "bfloat16")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
