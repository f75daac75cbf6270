"""Batched decode behind a shared prefix, with cascade attention on and off, in one run.

B requests share a ``--prefix``-token prompt head (a system prompt) and have distinct short
tails; after their prefills, decode steps are timed. With cascade attention the prefix's KV is
read once per layer for all B queries; without it, once per request (model/attention.py).
Two engines on the same weights, timed in alternating rounds so machine drift cancels in the
ratio. Run: ``python -m benchmarks.cascade`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvmosaic.engine import LLM, SamplingParams


def decode_step_ms(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Mean wall time of ``steps`` decode steps of all ``prompts`` together."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first step with every request decoding
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * elapsed / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=680, help="shared prompt tokens")
    p.add_argument("--tail", type=int, default=75, help="each request's own prompt tokens")
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quick", action="store_true", help="batch 4, 4 steps, one round")
    a = p.parse_args(argv)
    batches = [4] if a.quick else [int(x) for x in a.batches.split(",")]
    steps, rounds = (4, 1) if a.quick else (a.steps, a.rounds)
    engines = {on: LLM(dtype=a.dtype, cascade_attention=on) for on in (True, False)}
    engines[True].engine.runner.cascade = True  # even where the engine would not use it (model_runner.cascade_pays)
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(100, 49000) for _ in range(n)]  # noqa: E731
    print(f"decode step behind a shared {a.prefix}-token prefix, tails of {a.tail}, {a.dtype}, "
          f"{steps} steps x {rounds} rounds (median)\n")
    print("| batch | cascade ms/step | plain ms/step | plain / cascade |")
    print("|---|---|---|---|")
    for b in batches:
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            prefix = tokens(a.prefix)  # a fresh prefix each round: each engine computes it once
            prompts = [prefix + tokens(a.tail) for _ in range(b)]
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                times[on].append(decode_step_ms(engines[on], prompts, steps))
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {b} | {on:.1f} | {off:.1f} | {off / on:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
