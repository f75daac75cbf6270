"""What the shadow audit costs the streams beside it: a stream's inter-token gaps while answers from
automatically reused KV are audited (issue 24's audit; issue 25's "one request can hurt all").

One engine (``segment_reuse="auto"``, the serving stall target ``max_decode_stall_ms`` 500 unless
set), one stream decoding throughout, and behind it ``--requests`` prompts of issue 24's 1,900-token
system prompt, each with a new timestamp in its first line (all but the timestamp reused), one
after another. Three arms, in this order, on the same engine and requests:

* ``no audit``: ``auto_reuse_audit_rate`` 0 — the blends alone;
* ``audit, in pieces``: every answer audited, its full prefill cut into pieces of at most the
  prefill allowance beside decodes, one piece between two steps (blend/engine_hook.py);
* ``audit, whole``: every answer audited in one forward pass between two steps, as before the
  pieces (the engine's ``finish_pending`` called with no budget).

Per arm: the stream's inter-token gap p50 / p99 / max while the requests run, and the audits'
seconds. Run: ``python -m benchmarks.audit_stall --dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.auto_reuse_workloads import sys_requests
from kvmosaic.bench.machine import describe
from kvmosaic.engine.llm import LLM
from kvmosaic.engine.sampling_params import SamplingParams


def arm(llm: LLM, prompts: list[str], rate: float, whole: bool) -> tuple[list[float], float, int]:
    """The stream's gaps (s) while ``prompts`` are answered one after another, the audits' seconds, and
    how many audits ran."""
    e = llm.engine
    e.config.auto_reuse_audit_rate = rate
    sr = e.segment_reuse
    finish = sr.finish_pending
    if whole:
        sr.finish_pending = lambda cache, audit_budget=None: finish(cache, None)
    try:
        before = e.get_stats()
        stream = e.add_request("Tell me a long story about the sea, the harbour and its ships.",
                               SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True))
        while not stream.output_token_ids:
            e.step()
        mark = len(stream.inter_token_latencies)
        for p in prompts:
            seq = e.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            while seq.finish_reason is None:
                e.step()
        while sr.has_pending:
            e.step()  # the last audit's pieces, beside the stream
        gaps = stream.inter_token_latencies[mark:]
        e.abort_request(stream.request_id)
        e.finish_pending()
        after = e.get_stats()
    finally:
        sr.finish_pending = finish
    return gaps, after.auto_reuse_audit_seconds - before.auto_reuse_audit_seconds, \
        after.auto_reuse_audits - before.auto_reuse_audits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--stall-ms", type=float, default=500.0, help="max_decode_stall_ms (the serving default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(describe(), flush=True)
    llm = LLM(dtype=args.dtype, num_kv_blocks=1024, segment_cache_memory=1 << 30, segment_reuse="auto",
              max_decode_stall_ms=args.stall_ms)
    first, reqs = sys_requests(3 * args.requests + 1, random.Random(args.seed))
    llm.generate(first, SamplingParams(max_tokens=1))  # the system prompt stored
    llm.generate(reqs[0].prompt, SamplingParams(max_tokens=1))  # a warm-up blend
    batches = [[r.prompt for r in reqs[1 + i * args.requests:1 + (i + 1) * args.requests]] for i in range(3)]
    print("| arm | requests | stream gaps p50 / p99 / max, ms | audits | audit s (sum) |\n|---|---|---|---|---|")
    for (name, rate, whole), prompts in zip((("no audit", 0.0, False), ("audit, in pieces", 1.0, False),
                                             ("audit, whole", 1.0, True)), batches):
        t0 = time.perf_counter()
        gaps, audit_s, audits = arm(llm, prompts, rate, whole)
        ms = sorted(g * 1e3 for g in gaps)
        p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
        print(f"| {name} | {len(prompts)} | {statistics.median(ms):.1f} / {p99:.1f} / {ms[-1]:.1f} | {audits} | "
              f"{audit_s:.2f} |  ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
