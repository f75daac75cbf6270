"""The cost of live miss reasons on a no-reuse workload (issue 23): ``python -m benchmarks.lens_cost``.

One engine (prefix cache on) runs the same no-reuse workload (distinct random prompts) twice a
round, with the lens attached (the scheduler's ``lens``, the pool's observer) and detached,
alternating which goes first; the prefix cache is reset before every run. One engine, so the two
arms share weights, memory and threads and only the lens differs (a first version with two
engines in one process measured the lens-on engine 36-57% *faster* in every round, whichever ran
first: an artifact of the two engines, which no lens can cause). Reports:

* the throughput ratio on/off per round (median, IQR, min/max): the end-to-end figure, as noisy
  as the machine;
* the same ratio in CPU time of the engine's thread (``time.thread_time``; one torch thread, so
  the forward passes run on it): what the work costs, less what other processes take;
* the time spent inside the lens itself (``CacheLens.on_admit`` and the pool observer's calls,
  timed by wrappers) as a share of the "on" engine's wall time: the same cost, free of the
  noise of other processes.

``--model-free``: the scheduler and cache managers alone (no model), the same no-reuse prompts,
lens on and off: the bookkeeping's CPU time per request (median of 5 alternating runs), both
backends — what the lens adds, without a forward pass to hide it.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.cache.hash_manager import HashCacheManager
from kvmosaic.cache.hashing import get_hash_fn, make_seed
from kvmosaic.cache.lens import CacheLens
from kvmosaic.cache.radix import RadixCacheManager
from kvmosaic.cache.watch import CacheWatch
from kvmosaic.engine.dry_run import dry_step
from kvmosaic.engine.sampling_params import SamplingParams
from kvmosaic.engine.scheduler import Scheduler, SchedulerConfig
from kvmosaic.engine.sequence import Sequence


class Timed:
    """Wraps ``obj.name`` so that every call adds its duration to ``self.seconds``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, obj, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        setattr(obj, name, timed)


def run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds of this thread, tokens (prompt + generated)."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    t, c = time.perf_counter(), time.thread_time()
    for p in prompts:
        engine.add_request(p, params)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
    return time.perf_counter() - t, time.thread_time() - c, sum(len(p) for p in prompts) + tokens


def bookkeeping(backend: str, lens_on: bool, prompts: list[list[int]], max_tokens: int) -> float:
    """CPU seconds per request of the real scheduler and cache manager, stepped without a model."""
    seed = make_seed("lens-cost", "float32", 16, "sha256")
    watch = CacheWatch(max_ghosts=4096) if lens_on else None
    pool = BlockPool(600, 16, observer=watch)
    mgr = RadixCacheManager(pool, seed, hash_fn=get_hash_fn("sha256")) if backend == "radix" \
        else HashCacheManager(pool, seed, get_hash_fn("sha256"))
    sched = Scheduler(SchedulerConfig(4096, 16, 1 << 16), mgr, lens=CacheLens(mgr, watch) if lens_on else None)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    c = time.thread_time()
    for i, p in enumerate(prompts):
        sched.add(Sequence(f"r{i}", None, p, params))
    while sched.has_unfinished():
        dry_step(sched, max_tokens)
    return (time.thread_time() - c) / len(prompts)


def model_free(args) -> int:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in range(400)]
    for backend in ("hash", "radix"):
        runs: dict[bool, list[float]] = {True: [], False: []}
        for r in range(5):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                runs[on].append(bookkeeping(backend, on, prompts, args.max_tokens))
        on, off = float(np.median(runs[True])), float(np.median(runs[False]))
        print(f"{backend}: bookkeeping CPU per {args.prompt_tokens}-token request ({args.max_tokens} decode steps), "
              f"median of 5: lens on {on * 1e6:.0f} us, off {off * 1e6:.0f} us; the lens adds {(on - off) * 1e6:.0f} us")
    return 0


def spread(values: list[float]) -> dict:
    v = np.asarray(values)
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "min": float(v.min()), "max": float(v.max()),
            "n": len(v)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefix-cache", default="hash", choices=["hash", "radix"])
    p.add_argument("--json", default=None)
    p.add_argument("--model-free", action="store_true", help="the bookkeeping alone (no model): see above")
    args = p.parse_args(argv)
    if args.model_free:
        return model_free(args)
    from kvmosaic.engine.llm_engine import LLMEngine
    common = dict(dtype=args.dtype, num_threads=args.threads, prefix_cache=args.prefix_cache,
                  num_kv_blocks=args.prompts * (args.prompt_tokens + args.max_tokens) // 16 + 64, max_model_len=2048)
    engine = LLMEngine(miss_reasons=True, **common)
    lens, watch = engine.lens, engine.watch
    hooks = Timed()
    hooks.wrap(lens, "on_admit")
    for name in ("on_cache", "on_uncache", "on_hit"):
        hooks.wrap(watch, name)

    def attach(on: bool) -> None:
        engine.scheduler.lens = lens if on else None
        engine.pool.observer = watch if on else None

    rng = random.Random(0)
    ratios, cpu_ratios, wall_on = [], [], 0.0
    for on in (True, False):  # warm both arms
        attach(on)
        run(engine, [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(4)], 4)
    hooks.seconds, hooks.calls = 0.0, 0
    for r in range(args.rounds):
        prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
        tps, cps = {}, {}
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            attach(name == "on")
            secs, cpu, toks = run(engine, prompts, args.max_tokens)
            tps[name], cps[name] = toks / secs, toks / cpu
            if name == "on":
                wall_on += secs
        ratios.append(tps["on"] / tps["off"])
        cpu_ratios.append(cps["on"] / cps["off"])
        print(f"round {r}: on {tps['on']:.1f} tok/s, off {tps['off']:.1f} tok/s, ratio {ratios[-1]:.4f}; "
              f"per CPU second on/off {cpu_ratios[-1]:.4f}", flush=True)
    out = {"wall": spread(ratios), "cpu": spread(cpu_ratios), "hook_seconds": hooks.seconds, "hook_calls": hooks.calls,
           "wall_on_seconds": wall_on, "hook_share": hooks.seconds / wall_on, "args": vars(args)}
    for key, what in (("wall", "throughput on/off"), ("cpu", "tokens per CPU second on/off")):
        s = out[key]
        print(f"{what}: median {s['median']:.4f} (IQR {s['q1']:.4f}-{s['q3']:.4f}; min {s['min']:.4f}, "
              f"max {s['max']:.4f}; n={s['n']})")
    print(f"time inside the lens: {hooks.seconds * 1e3:.1f} ms in {hooks.calls} calls = "
          f"{100 * hooks.seconds / wall_on:.3f}% of the 'on' engine's {wall_on:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
