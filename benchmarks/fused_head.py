"""The LM head inside the fused decode step against after it, in one process.

``FusedDecode.step`` ends a decode step with the final RMSNorm and the LM head in the same C call
when every row is sampled (docs/ARCHITECTURE.md, "The fused decode step"); without it the step
returns to Python for the norm, the head (a second parallel region) and the float32 widening. This
runs ``--batch`` requests of ``--tokens`` prompt tokens through the engine, then times whole engine
steps (``LLMEngine.step``: scheduling, the step, sampling, output) switching between the two every
``--switch`` steps, so that both see the same minutes of this shared machine, and prints the median.

Run: ``python -m benchmarks.fused_head`` from the repository root (``--batch``, ``--tokens``,
``--steps``, ``--dtype``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvmosaic.bench.machine import describe
from kvmosaic.engine.llm import LLM
from kvmosaic.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=750)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--switch", type=int, default=10)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    engine = LLM(dtype=args.dtype, enable_prefix_caching=False).engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 2, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request({"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.tokens)]}, params, f"r{i}")
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode builds the fused step
    fused = engine.model._fused
    if not fused or fused.head is None:
        raise SystemExit("no fused step with its head in decode tiles on this CPU")
    head = fused.head
    times: dict[str, list[float]] = {"head after the step": [], "head in the step": []}
    for n in range(args.steps):
        mode = "head after the step" if (n // args.switch) % 2 == 0 else "head in the step"
        fused.head = None if mode == "head after the step" else head
        start = time.perf_counter()
        engine.step()
        times[mode].append(time.perf_counter() - start)
    fused.head = head
    print(describe())
    print(f"batch {args.batch}, {args.tokens}-token prompts, {args.dtype}, {args.steps} steps switched every {args.switch}")
    for mode, ts in times.items():
        print(f"{mode}: engine step p50 {statistics.median(ts) * 1e3:.2f} ms, mean {statistics.mean(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
