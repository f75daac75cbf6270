"""Priority scheduling (``scheduling_policy="priority"``, engine/priority.py), on the real scheduler
and cache managers without a model (``dry_step``), in both cache backends, and through the engine."""

from __future__ import annotations

import random
import zlib

import pytest
from sched_sim import make_manager, rand_tokens

from kvmosaic import SamplingParams
from kvmosaic.engine.dry_run import dry_step
from kvmosaic.engine.scheduler import Scheduler, SchedulerConfig
from kvmosaic.engine.sequence import Sequence

BACKENDS = ["hash", "radix"]


def _scheduler(backend: str, policy: str = "priority", num_blocks: int = 64, max_num_seqs: int = 4,
               budget: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, max_num_seqs, 1 << 16, policy), make_manager(backend, num_blocks))


def _seq(name: str, priority: int, arrival: float, tokens: int = 40, max_tokens: int = 1000, seed: int = 0) -> Sequence:
    prompt = rand_tokens(random.Random(zlib.crc32(name.encode()) + seed), tokens)
    return Sequence(name, None, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority,
                    arrival_time=arrival)


def _ids(seqs) -> set[str]:
    return {s.request_id for s in seqs}


def _admission_order(sched: Scheduler, max_tokens: int = 4) -> list[str]:
    order: list[str] = []
    while sched.has_unfinished():
        for s in dry_step(sched, max_tokens).scheduled:
            if s.seq.request_id not in order:
                order.append(s.seq.request_id)
    return order


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_queue_is_served_by_priority_then_arrival(backend):
    sched = _scheduler(backend, max_num_seqs=1)
    for name, prio, t in [("low-early", 0, 0.0), ("high-late", 5, 3.0), ("mid", 2, 1.0), ("high-early", 5, 2.0)]:
        sched.add(_seq(name, prio, t))
    assert _admission_order(sched) == ["high-early", "high-late", "mid", "low-early"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fcfs_keeps_arrival_order_whatever_the_priority(backend):
    sched = _scheduler(backend, policy="fcfs", max_num_seqs=1)
    for name, prio, t in [("a", 0, 0.0), ("b", 5, 1.0), ("c", 2, 2.0)]:
        sched.add(_seq(name, prio, t))
    assert _admission_order(sched) == ["a", "b", "c"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_more_important_arrival_preempts_the_least_important_when_slots_are_full(backend):
    sched = _scheduler(backend, max_num_seqs=2)
    low, mid = _seq("low", 0, 0.0), _seq("mid", 1, 1.0)
    sched.add(low)
    sched.add(mid)
    for _ in range(3):
        dry_step(sched, 1000)
    assert _ids(sched.running) == {"low", "mid"}
    urgent = _seq("urgent", 9, 2.0)
    sched.add(urgent)
    out = dry_step(sched, 1000)
    assert out.preempted == [low] and low.num_computed_tokens == 0 and low.num_preemptions == 1
    assert urgent in [s.seq for s in out.scheduled]  # admitted in the same step
    assert _ids(sched.running) == {"mid", "urgent"} and list(sched.waiting) == [low]
    # an equal or lower priority never preempts
    sched.add(_seq("peer", 1, 3.0))
    assert dry_step(sched, 1000).preempted == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_pool_preempts_the_least_important_running_request(backend):
    """8 blocks of 16 tokens: two 40-token prompts take 6; as they decode past 64 tokens each the
    pool runs out and the least important goes, though it arrived first (FCFS preempts the newest)."""
    sched = _scheduler(backend, num_blocks=8)
    important, other = _seq("important", 3, 1.0), _seq("other", 0, 0.0)
    sched.add(other)
    dry_step(sched, 1000)
    sched.add(important)
    preempted = []
    for _ in range(40):
        preempted += dry_step(sched, 1000).preempted
        if preempted:
            break
    assert preempted == [other]
    assert important in sched.running


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_urgent_request_preempts_when_the_pool_lacks_its_blocks(backend):
    sched = _scheduler(backend, num_blocks=8, max_num_seqs=8)
    hog = _seq("hog", 0, 0.0, tokens=100)
    sched.add(hog)
    dry_step(sched, 1000)
    assert sched.running == [hog]  # 7 of 8 blocks
    urgent = _seq("urgent", 1, 1.0, tokens=40)
    sched.add(urgent)
    out = dry_step(sched, 1000)
    assert out.preempted == [hog] and [s.seq for s in out.scheduled] == [urgent]
    # the hog comes back after it and runs to its end
    assert _admission_order(sched, max_tokens=3) == ["urgent", "hog"] and hog.num_preemptions == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_priorities_leave_the_pool_whole(backend):
    """Many requests of random priorities, lengths and arrivals, preempting each other: all end,
    and the pool accounts for every block (invariant 2)."""
    rng = random.Random(3)
    sched = _scheduler(backend, num_blocks=24, max_num_seqs=3, budget=64)
    preempted = 0
    for i in range(30):
        sched.add(_seq(f"r{i}", rng.randint(-2, 2), float(i), tokens=rng.randint(5, 90), max_tokens=rng.randint(1, 30)))
        for _ in range(rng.randint(0, 3)):
            preempted += len(dry_step(sched, 30).preempted)
    while sched.has_unfinished():
        preempted += len(dry_step(sched, 30).preempted)
    assert preempted >= 5
    mgr = sched.kv
    info = mgr.size_info()
    assert info.in_use == 0 and info.free + info.evictable == info.total
    mgr.pool.check_invariants()
    if hasattr(mgr, "check_invariants"):  # the radix tree's own
        mgr.check_invariants()
    assert mgr.reset_prefix_cache() and mgr.pool.num_free_blocks == mgr.pool.num_blocks


def test_the_engine_serves_by_priority():
    """Through the engine: with one running slot, the more important request's tokens come first."""
    from tests.conftest import make_llm

    llm = make_llm(scheduling_policy="priority", max_num_seqs=1)
    e = llm.engine
    first = []
    for name, prio in [("low", 0), ("high", 5), ("mid", 2)]:
        e.add_request({"prompt_token_ids": list(range(100, 130))}, SamplingParams(max_tokens=2, ignore_eos=True),
                      request_id=name, priority=prio)
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                first.append(out.request_id)
    assert first == ["high", "mid", "low"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_preemption_for_a_request_no_pool_could_hold(backend):
    sched = _scheduler(backend, num_blocks=8)
    running = _seq("running", 0, 0.0)
    sched.add(running)
    dry_step(sched, 1000)
    sched.add(_seq("huge", 9, 1.0, tokens=200))  # its first chunk alone needs 13 blocks of 8
    assert dry_step(sched, 1000).preempted == [] and sched.running == [running]


def test_priority_preempts_for_blocks_under_the_hybrid_layout():
    """A sliding-window model's layout holds a block per group and token span: the blocks an urgent
    request needs are counted over every group (``HybridCacheManager.num_blocks_needed``)."""
    from kvmosaic.cache.block_pool import BlockPool
    from kvmosaic.cache.hashing import get_hash_fn
    from kvmosaic.cache.hybrid import HybridCacheManager
    from kvmosaic.cache.kv_groups import KVLayout

    mgr = HybridCacheManager(BlockPool(12, 16), b"\x01" * 32, get_hash_fn("sha256"), KVLayout.plan([None, 32]), True)
    sched = Scheduler(SchedulerConfig(256, 8, 1 << 16, "priority"), mgr)
    hog = _seq("hog", 0, 0.0, tokens=64)  # 4 blocks in each of the 2 groups: 8 of 12
    sched.add(hog)
    dry_step(sched, 1000)
    urgent = _seq("urgent", 1, 1.0, tokens=40)  # 3 blocks a group: 6, where 4 are free
    assert mgr.num_blocks_needed(urgent, 40, None) == 6
    sched.add(urgent)
    out = dry_step(sched, 1000)
    assert out.preempted == [hog] and [s.seq for s in out.scheduled] == [urgent]
