"""A model-free driver of the scheduler: the real :class:`Scheduler` and cache managers, stepped
without a model (every scheduled sequence that has computed its prompt emits token 7).

Hit rates and admission order do not depend on KV values, so scheduling policies (LPM vs FCFS,
one computation per shared prefix in flight) are checked here in seconds;
``python -m benchmarks.radix_figures --only lpm`` draws its figure with the same driver.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.cache.hash_manager import HashCacheManager
from kvmosaic.cache.hashing import get_hash_fn, make_seed
from kvmosaic.cache.manager import KVCacheManager
from kvmosaic.cache.radix import RadixCacheManager
from kvmosaic.engine.dry_run import dry_step
from kvmosaic.engine.sampling_params import SamplingParams
from kvmosaic.engine.scheduler import Scheduler, SchedulerConfig
from kvmosaic.engine.sequence import Sequence

SEED = make_seed("bench", "float32", 16, "sha256_cbor")


def make_manager(kind: str, num_blocks: int, block_size: int = 16, hash_algo: str = "sha256_cbor") -> KVCacheManager:
    pool = BlockPool(num_blocks, block_size)
    if kind == "radix":
        return RadixCacheManager(pool, SEED)
    return HashCacheManager(pool, SEED, get_hash_fn(hash_algo), enable_caching=kind == "hash")


# ---- workloads ---------------------------------------------------------------------------

def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def multi_tenant(rng: random.Random, tenants: int, requests: int) -> list[list[int]]:
    """Tenants with system prompts of irregular lengths (150-400 tokens), requests
    interleaved at random, each a short question of irregular length."""
    systems = [rand_tokens(rng, rng.randint(150, 400)) for _ in range(tenants)]
    return [rng.choice(systems) + rand_tokens(rng, rng.randint(5, 40)) for _ in range(requests)]


@dataclass
class SchedRun:
    policy: str
    backend: str
    hit_rate: float
    steps: int
    max_wait_rounds: int


def simulate(prompts: list[list[int]], backend: str, policy: str, num_blocks: int,
             max_num_seqs: int = 4, max_tokens: int = 8, budget: int = 512) -> SchedRun:
    """Run the real scheduler and cache manager to the end of every request; the "model" emits
    token 7 per step. Raises if it has not ended after 100,000 steps."""
    mgr = make_manager(backend, num_blocks)
    sched = Scheduler(SchedulerConfig(budget, max_num_seqs, 1 << 16, policy), mgr)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = []
    for i, p in enumerate(prompts):
        seq = Sequence(f"r{i}", None, list(p), params, arrival_time=float(i))
        sched.add(seq)
        seqs.append(seq)
    admitted_at: dict[str, int] = {}
    steps = 0
    while sched.has_unfinished():
        out = dry_step(sched, max_tokens)
        steps += 1
        for s in out.scheduled:
            admitted_at.setdefault(s.seq.request_id, steps)
        if steps > 100_000:
            raise RuntimeError("the simulation does not terminate")
    # Rounds a request waited beyond its FCFS turn (a proxy for the starvation bound).
    fcfs_rank = {s.request_id: i for i, s in enumerate(seqs)}
    order = sorted(admitted_at, key=lambda r: (admitted_at[r], fcfs_rank[r]))
    passed = [sum(1 for o in order[: order.index(r)] if fcfs_rank[o] > fcfs_rank[r]) for r in order]
    return SchedRun(policy, backend, mgr.stats.hit_rate, steps, max(passed))
