"""What prompt log-probabilities cost (``SamplingParams.prompt_logprobs``, the server's ``echo`` with
``logprobs``): ``python -m benchmarks.prompt_logprobs_cost``.

In one process, on ``--prompts`` distinct prompts of ``--tokens`` random token ids (nothing
cached), the time of a one-token request with and without prompt log-probabilities, alternated:
the difference is the head over every prompt row (in slices of 64) and the scoring. Then what a
log-likelihood evaluation sends (lm-evaluation-harness: one context, several continuations, each
scored whole): without the scored prefix cache the context's tokens are computed again for each
continuation, since such a request reads no cache (vLLM's rule); with it
(``scored_prefix_cache_memory``, engine/scored_prefix.py) once. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvmosaic import LLM, SamplingParams
from kvmosaic.bench.machine import describe


def timed(llm: LLM, ids: list[int], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], params)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prompt_logprobs_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=745)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--context", type=int, default=600, help="log-likelihood: the shared context's tokens")
    p.add_argument("--continuations", type=int, default=4)
    args = p.parse_args(argv)
    print(describe())
    llm = LLM(dtype=args.dtype)
    rng = random.Random(0)
    plain = SamplingParams(max_tokens=1, temperature=0)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.tokens)] for _ in range(2 * args.prompts + 1)]
    timed(llm, prompts.pop(), scored)  # the scoring path's first call
    a, b = [], []
    for _ in range(args.prompts):
        a.append(timed(llm, prompts.pop(), plain))
        b.append(timed(llm, prompts.pop(), scored))
    pa, pb = statistics.median(a), statistics.median(b)
    print(f"\n{args.dtype}, {args.tokens}-token prompts, {args.prompts} each, alternated, medians")
    print("| request | time ms | vs plain |\n|---|---|---|")
    print(f"| plain | {pa * 1e3:.0f} | 1.00 |\n| prompt_logprobs=1 | {pb * 1e3:.0f} | {pb / pa:.2f} |")
    stored = LLM(dtype=args.dtype, scored_prefix_cache_memory=256 << 20)
    print(f"\nlog-likelihood of {args.continuations} continuations of one {args.context}-token context, batched "
          f"(a new context each time; {args.prompts} of each alternated, medians)")
    print("| engine | time ms | prompt tok/s | cached tokens | vs computed whole |\n|---|---|---|---|---|")
    runs: dict[str, list[tuple[float, int, int]]] = {"computed whole": [], "--scored-prefix-cache-memory 256M": []}
    for _ in range(args.prompts):
        for name, engine in zip(runs, (llm, stored)):
            context = [rng.randrange(100, 40000) for _ in range(args.context)]
            conts = [[rng.randrange(100, 40000) for _ in range(5)] for _ in range(args.continuations)]
            t0 = time.perf_counter()
            outs = engine.generate([{"prompt_token_ids": context + c} for c in conts], [scored] * len(conts))
            wall = time.perf_counter() - t0
            runs[name].append((wall, sum(len(o.prompt_token_ids) for o in outs), sum(o.num_cached_tokens for o in outs)))
    base = statistics.median(w for w, _, _ in runs["computed whole"])
    for name, rows in runs.items():
        wall = statistics.median(w for w, _, _ in rows)
        print(f"| {name} | {wall * 1e3:.0f} | {rows[0][1] / wall:,.0f} | {rows[0][2]} | {base / wall:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
