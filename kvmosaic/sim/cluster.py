"""The simulation: replicas that schedule like the engine, over the real cache managers.

A replica step (as ``engine/scheduler.py`` does, simplified): admit waiting requests FCFS while
seats and blocks last (the prefix match happens at admission, on the real manager); then a token
budget of ``MAX_BATCHED_TOKENS`` goes to one decode token per decoding sequence and the rest to
prefill chunks, FCFS. The step's duration is ``cost.step_ms``. At the end of a step computed
blocks are committed (the pool emits its real events), a finished request commits its generated
tokens too (multi-turn reuse) and frees its blocks.

Events reach the router's index ``event_delay_s`` after the step that produced them (the
publisher's and subscriber's latency). Invariant: the router sees a replica's cache only through
those events (the oracle excepted), and sees load exactly (queued prefill tokens, running).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque

from ..cache.block_pool import BlockPool
from ..cache.events import EventLog
from ..cache.hash_manager import HashCacheManager
from ..cache.hashing import get_hash_fn
from ..cache.manager import PlainRequest
from ..router.index import ClusterIndex
from ..router.policies import ReplicaLoad, RouteRequest
from ..router.prompt_hashes import PromptHasher
from ..server.events import KVEventBatch, to_wire
from . import cost
from .workload import SimRequest


class _Seq:
    __slots__ = ("computed", "generated", "plain", "req")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.plain = PlainRequest(req.request_id, list(req.prompt), req.salt)
        self.computed = 0
        self.generated = 0


class SimReplica:
    def __init__(self, rid: str, hasher: PromptHasher, num_blocks: int) -> None:
        self.rid = rid
        self.pool = BlockPool(num_blocks, hasher.block_size, events=EventLog(enabled=True))
        self.mgr = HashCacheManager(self.pool, hasher.seed, get_hash_fn(hasher.hash_algo))
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.busy = False
        self.busy_s = 0.0
        self.queued_tokens = 0  # prompt tokens not yet prefilled, waiting or running
        self.pending: Counter[bytes] = Counter()  # chains of routed, not yet prefilled requests
        self.seq_no = 0

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.rid, self.queued_tokens, len(self.running))

    def exact_held(self, chain: list[bytes]) -> int:
        n = 0
        for h in chain:
            if h not in self.pool.cached and h not in self.pending:
                break
            n += 1
        return n * self.pool.block_size

    def add(self, req: SimRequest) -> None:
        self.waiting.append(_Seq(req))
        self.queued_tokens += len(req.prompt)
        self.pending.update(req.hashes)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < cost.MAX_NUM_SEQS:
            s = self.waiting[0]
            match = self.mgr.match_prefix(s.plain)
            total = len(s.req.prompt) + len(s.req.output)
            if self.mgr.allocate_slots(s.plain, total, match) is None:
                break
            self.mgr.record_query(s.plain, match)
            self.waiting.popleft()
            s.computed = s.req.cached = match.num_tokens
            self.queued_tokens -= match.num_tokens
            self.running.append(s)

    def step(self) -> float:
        """Plan one step; returns its duration in seconds (0 when idle)."""
        self._admit()
        budget = cost.MAX_BATCHED_TOKENS
        self._plan: list[tuple[_Seq, int]] = []
        decode = [s for s in self.running if s.computed >= len(s.req.prompt)]
        budget -= len(decode)
        chunks = []
        for s in self.running:
            left = len(s.req.prompt) - s.computed
            if left > 0 and budget > 0:
                n = min(left, budget)
                budget -= n
                chunks.append((s.computed, n))
                self._plan.append((s, n))
        self._decode = decode
        if not decode and not chunks:
            return 0.0
        return cost.step_ms(len(decode), chunks) / 1000

    def finish_step(self, now: float) -> list[SimRequest]:
        done = []
        for s, n in self._plan:
            s.computed += n
            self.queued_tokens -= n
            self.mgr.commit(s.plain, s.computed)
            if s.computed == len(s.req.prompt):
                s.req.first_token = now
                s.generated = 1
                for h in s.req.hashes:
                    if self.pending[h] <= 1:
                        del self.pending[h]
                    else:
                        self.pending[h] -= 1
        for s in self._decode:
            s.generated += 1
        for s in list(self.running):
            if s.req.first_token is not None and s.generated >= len(s.req.output):
                s.plain.all_token_ids.extend(s.req.output)
                self.mgr.commit(s.plain, len(s.plain.all_token_ids) - 1)
                self.mgr.free(s.plain)
                self.running.remove(s)
                s.req.finished = now
                done.append(s.req)
        return done

    def drain_events(self, ts: float) -> tuple[int, KVEventBatch] | None:
        evs = self.pool.events.drain()
        if isinstance(evs, tuple):  # (events, dropped) since issue 10: a drop skips a number
            evs, dropped = evs
            self.seq_no += 1 if dropped else 0
        if not evs:
            return None
        self.seq_no += 1
        return self.seq_no - 1, KVEventBatch(ts, [to_wire(e) for e in evs])


def simulate(requests: list[SimRequest], num_replicas: int, make_policy, hasher: PromptHasher,
             event_delay_s: float = 0.01, sample_every_s: float = 1.0) -> dict:
    """Run ``requests`` through ``num_replicas`` replicas; ``make_policy(index, replicas)``
    builds the policy (it may use the index, or the replicas for the oracle)."""
    clock = [0.0]
    index = ClusterIndex(hasher.block_size, clock=lambda: clock[0])
    replicas = [SimReplica(f"replica-{i}", hasher, cost.pool_blocks(hasher.block_size)) for i in range(num_replicas)]
    by_id = {r.rid: r for r in replicas}
    for r in replicas:
        index.add_replica(r.rid)
    policy = make_policy(index, by_id)
    heap: list = []
    tie = itertools.count()
    for req in requests:
        heapq.heappush(heap, (req.arrival, next(tie), "arrive", req))
    heapq.heappush(heap, (0.0, next(tie), "sample", None))
    decide_s, hash_s, imbalance, done = [], [], [], 0

    def kick(rep: SimReplica, now: float) -> None:
        if not rep.busy:
            dt = rep.step()
            if dt > 0:
                rep.busy = True
                rep.busy_s += dt
                heapq.heappush(heap, (now + dt, next(tie), "step", rep))

    while heap:
        now, _, kind, obj = heapq.heappop(heap)
        clock[0] = now
        if kind == "arrive":
            t0 = time.perf_counter()
            obj.hashes = hasher.hashes(obj.prompt, obj.salt)
            hash_s.append(time.perf_counter() - t0)
            rr = RouteRequest(obj.request_id, obj.prompt, obj.salt, hashes=obj.hashes)
            loads = [r.load() for r in replicas]
            t1 = time.perf_counter()
            rid, obj.reason = policy.choose(rr, loads)
            t2 = time.perf_counter()
            decide_s.append(t2 - t1)
            obj.replica, obj.predicted = rid, rr.predicted_cached_tokens
            by_id[rid].add(obj)
            kick(by_id[rid], now)
        elif kind == "step":
            obj.busy = False
            done += len(obj.finish_step(now))
            ev = obj.drain_events(now)
            if ev is not None:
                heapq.heappush(heap, (now + event_delay_s, next(tie), "events", (obj.rid, ev)))
            kick(obj, now)
        elif kind == "events":
            rid, (seq, batch) = obj
            index.apply(rid, seq, batch, now)
        elif kind == "sample":
            q = [r.queued_tokens for r in replicas]
            if sum(q) > 0:
                imbalance.append(max(q) / (sum(q) / len(q)))
            if done < len(requests):
                heapq.heappush(heap, (now + sample_every_s, next(tie), "sample", None))
    return {"index": index, "replicas": replicas, "decide_s": decide_s, "hash_s": hash_s,
            "imbalance": imbalance, "end": clock[0]}
