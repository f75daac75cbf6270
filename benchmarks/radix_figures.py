"""Figures for the radix backend and cache-aware scheduling (issue 3).

    python -m benchmarks.radix_figures            # every section
    python -m benchmarks.radix_figures --only lookup lpm   # the model-free sections

Sections:

* ``reuse`` / ``multiturn``: shared-system-prompt and multi-turn workloads with prompts of irregular lengths
  on the shipped model (float32, CPU): tokens reused by the hash and the radix backends and
  the TTFT that follows (requests one at a time, so TTFT is the prefill of what was missed);
* ``cow``: what a copy-on-write of a partial block costs against recomputing its tokens;
* ``lookup``: CPU time of one prefix lookup for a 32k-token prompt in each backend;
* ``lpm``: hit rate of LPM against FCFS ordering under cache pressure on a multi-tenant
  workload. This drives the real :class:`Scheduler` and cache managers with the tests'
  model-free step loop (``tests/sched_sim.py``; hit rates do not depend on the KV values), so
  it runs in seconds. Run from the repository root (``python -m benchmarks.radix_figures``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from kvmosaic.cache.manager import KVCacheManager
from kvmosaic.engine.sampling_params import SamplingParams
from tests.sched_sim import make_manager, multi_tenant, rand_tokens, simulate


def section_lpm(args) -> None:
    rng = random.Random(0)
    prompts = multi_tenant(rng, tenants=8, requests=160)
    print("\n## Hit rate, LPM vs FCFS, multi-tenant under cache pressure")
    print("8 tenants (system prompts 150-400 tokens), 160 requests interleaved at random, "
          "max_num_seqs 4, 8 output tokens, block 16")
    print("| pool (blocks) | backend | FCFS hit rate | LPM hit rate | steps FCFS / LPM "
          "| LPM: most later arrivals admitted ahead of one request |")
    print("|---|---|---|---|---|---|")
    for blocks in (48, 96, 160):
        for backend in ("hash", "radix"):
            f = simulate(prompts, backend, "fcfs", blocks)
            lpm = simulate(prompts, backend, "lpm", blocks)
            print(f"| {blocks} | {backend} | {f.hit_rate:.1%} | {lpm.hit_rate:.1%} | {f.steps} / {lpm.steps} "
                  f"| {lpm.max_wait_rounds} |")


# ---- lookup CPU time -----------------------------------------------------------------------

class _Req:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id, self.all_token_ids = rid, tokens
        self.cache_salt = self.adapter_id = None
        self.priority = 0


def _cache_prompt(mgr: KVCacheManager, tokens: list[int]) -> None:
    req = _Req("warm", tokens)
    mgr.allocate_slots(req, len(tokens), mgr.match_prefix(req))
    mgr.commit(req, len(tokens))
    mgr.free(req)


def time_lookup(mgr: KVCacheManager, tokens: list[int], reps: int) -> float:
    """Median ms of a first lookup (a fresh request: hash chains are built per request)."""
    times = []
    for i in range(reps):
        req = _Req(f"q{i}", tokens)
        t = time.perf_counter()
        mgr.match_prefix(req)
        times.append(time.perf_counter() - t)
        mgr.free(req)
    return statistics.median(times) * 1e3


def section_lookup(args) -> None:
    rng = random.Random(1)
    n = 32 * 1024
    prompt = rand_tokens(rng, n)
    half = prompt[: n // 2] + rand_tokens(rng, n // 2)
    print("\n## CPU time of one lookup, 32k-token prompt (block 16, median of 5, ms)")
    print("| backend | full hit (32k) | diverges at 16k | miss |")
    print("|---|---|---|---|")
    miss = rand_tokens(rng, n)
    for kind, algo in (("hash", "sha256_cbor"), ("hash", "xxh3_128"), ("radix", "-")):
        mgr = make_manager(kind, n // 16 + 8, hash_algo=algo if algo != "-" else "sha256_cbor")
        _cache_prompt(mgr, prompt)
        figures = [time_lookup(mgr, q, 5) for q in (prompt + [1], half, miss)]
        label = f"{kind} ({algo})" if kind == "hash" else "radix"
        print(f"| {label} | " + " | ".join(f"{x:.2f}" for x in figures) + " |")


# ---- with the model: reuse, TTFT, copy-on-write ----------------------------------------------

def _llm(backend: str, **kw):
    from kvmosaic.engine.llm import LLM

    return LLM(dtype="float32", device="cpu", prefix_cache=backend, num_kv_blocks=512, **kw)


BACKENDS = ("none", "hash", "radix")


@dataclass
class Tally:
    prompt_tokens: int = 0
    reused: int = 0
    ttfts: list[float] | None = None

    def add(self, prompt_len: int, out, count_ttft: bool) -> None:
        self.prompt_tokens += prompt_len
        self.reused += out.num_cached_tokens
        if count_ttft:
            self.ttfts = (self.ttfts or []) + [out.metrics["ttft"]]

    def row(self, workload: str, backend: str) -> str:
        ttft = statistics.median(self.ttfts) * 1e3 if self.ttfts else float("nan")
        return f"| {workload} | {backend} | {self.prompt_tokens} | {self.reused} | {ttft:.0f} |"


def _one(llm, prompt: list[int], max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    return out


def shared_system_prompts(rng: random.Random) -> list[list[int]]:
    system = rand_tokens(rng, 203)
    return [system + rand_tokens(rng, rng.randint(3, 29)) for _ in range(7)]


def _header(ttft_label: str) -> None:
    print(f"| workload | backend | prompt tokens | reused | {ttft_label} |")
    print("|---|---|---|---|---|")


def section_reuse(args) -> None:
    """Requests one at a time; the backends take turns on each request, so that they see
    the same machine load (these machines are shared and noisy)."""
    print("\n## Tokens reused and TTFT, shipped model, float32, CPU (requests one at a time)")
    _header("median TTFT after the first request (ms)")
    llms = {b: _llm(b) for b in BACKENDS}
    tallies = {b: Tally() for b in BACKENDS}
    for i, p in enumerate(shared_system_prompts(random.Random(2))):
        for b in BACKENDS:
            tallies[b].add(len(p), _one(llms[b], p, 4), count_ttft=i > 0)
    for b in BACKENDS:
        print(tallies[b].row("shared system prompt (203 tok + 3-29)", b))


def section_multiturn(args) -> None:
    _header("median TTFT of turns 2-3 (ms)")
    llms = {b: _llm(b) for b in BACKENDS}
    tallies = {b: Tally() for b in BACKENDS}
    rng = random.Random(3)
    for _conv in range(2):
        history = rand_tokens(rng, rng.randint(40, 90))
        for turn in range(3):
            outs = {b: _one(llms[b], history, 8) for b in BACKENDS}
            for b in BACKENDS:
                tallies[b].add(len(history), outs[b], count_ttft=turn > 0)
            assert len({tuple(o.token_ids) for o in outs.values()}) == 1, "backends disagree"
            history = history + outs["none"].token_ids + rand_tokens(rng, rng.randint(5, 23))
    for b in BACKENDS:
        print(tallies[b].row("multi-turn (2 conv x 3 turns, 8-token answers)", b))


def section_cow(args) -> None:
    import torch

    llm = _llm("hash", block_size=16)
    kv = llm.engine.kv
    copies = []
    for _ in range(200):
        t = time.perf_counter()
        kv.copy_blocks([(1, 2, 15)])
        copies.append(time.perf_counter() - t)
    copy_ms, copy_min = statistics.median(copies) * 1e3, min(copies) * 1e3
    rng = random.Random(4)
    base = rand_tokens(rng, 160)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([base + [5]], params)
    per = {}
    for extra in (1, 16):
        ts = []
        for _ in range(3):
            (o,) = llm.generate([base + rand_tokens(rng, extra)], params)
            ts.append(o.metrics["ttft"])
        per[extra] = statistics.median(ts) * 1e3
    per_token = (per[16] - per[1]) / 15
    print("\n## Copy-on-write of a partial block vs recomputing it (float32, CPU)")
    print(f"copy of one block's KV (30 layers, 15 slots, median of 200): {copy_ms:.3f} ms "
          f"(fastest {copy_min:.3f}); "
          f"prefill after a 160-token hit: {per[1]:.0f} ms for 1 token, {per[16]:.0f} ms for 16 "
          f"(~{per_token:.2f} ms per extra token); threads {torch.get_num_threads()}")
    print(f"copying pays when it saves more than {copy_ms / max(per_token, 1e-9):.3f} token(s) of prefill")


SECTIONS = {"lookup": section_lookup, "lpm": section_lpm, "cow": section_cow, "reuse": section_reuse,
            "multiturn": section_multiturn}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    args = p.parse_args(argv)
    for name in args.only:
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
