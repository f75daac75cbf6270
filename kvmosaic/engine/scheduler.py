"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget (``max_num_batched_tokens``):

1. running sequences first, oldest first: one token for a decode, the next chunk for a
   prefill in progress. When the pool has no block for one, the newest running sequence is
   preempted (its blocks freed, its progress reset; it goes back to the head of the queue
   and recomputes, usually hitting its own cached blocks);
2. then waiting sequences are admitted while budget, sequence slots and blocks last, each
   starting after its cached prefix. New prefills thus join running decodes.

One computation per shared prefix in flight: a waiting sequence whose next uncached block is
being computed right now by another sequence (running, or admitted earlier in this step) is
passed over until that block is committed, then hits it instead of computing it again — a
burst of requests sharing a system prompt computes it once. It waits only while the other
sequence's prefill goes on, so nobody starves (tests: test_scheduler_inflight.py).

A sequence's KV for the scheduled tokens is written by the model runner; only after that
does :meth:`Scheduler.update` advance progress and let the cache index the new blocks.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from ..cache.manager import KVCacheManager, MatchResult
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 8192
    policy: str = "fcfs"  # "fcfs" or "lpm" (longest cached prefix first)
    max_skips: int = 8  # lpm: how many times a waiting request may be passed over


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # starting at seq.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences the whole pool cannot hold any longer: they end with finish reason "length".
    out_of_memory: list[Sequence] = field(default_factory=list)
    # Sequences whose storage-tier load raised (issue 14): (sequence, message); the engine fails
    # each alone and frees its blocks.
    failed: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def _tier_failure(exc: BaseException) -> str:
    return f"loading its KV from a storage tier failed: {type(exc).__name__}: {exc}"


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.skips: dict[str, int] = {}
        self._lpm_previous: dict[str, float] = {}  # waiting request -> arrival, at the last ordering
        # Storage tiers (kvmosaic/kv/tiered.py; None: off) and the requests waiting for their
        # background loads: request id -> (sequence, chain hashes, futures).
        self.tiers = None
        self.loading: dict[str, tuple[Sequence, list, list]] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.running):
            if seq.request_id == request_id:
                self.running.remove(seq)
                self.kv.free(seq)
                return seq
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self.kv.free(seq)
                return seq
        if request_id in self.loading:
            seq, _, futs = self.loading.pop(request_id)
            for f in futs:
                f.cancel()
            self.kv.free(seq)
            return seq
        return None

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed, budget)
            while self.kv.allocate_slots(seq, seq.num_computed_tokens + n) is None:
                if self.running == [seq]:  # alone and still too big: it can never continue
                    self._drop(seq, out)
                    break
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        if self.loading:
            self._poll_loads(idle=not out.scheduled and not self.waiting, failed=out.failed)
        if out.preempted or out.out_of_memory:
            return out
        self._order_waiting()
        inflight = self._inflight_blocks() if self.kv.enable_caching else None
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            match = self.kv.match_prefix(seq)
            if inflight and self._next_block_in_flight(seq, match, inflight):
                continue  # another sequence is computing it: hit it at a later step
            try:
                payloads = self._tier_payloads(seq, match) if match.tier_hits and self.tiers is not None else []
            except Exception as exc:  # noqa: BLE001 - a tier load fails this request alone
                self._leave_queue(seq)
                out.failed.append((seq, _tier_failure(exc)))
                continue
            if payloads is None:  # loading in the background: the others go on
                self._leave_queue(seq)
                continue
            cached = match.num_tokens + len(payloads) * self.kv.block_size
            n = min(seq.num_tokens - cached, budget)
            if self.kv.allocate_slots(seq, cached + n, match) is None:
                if not self.running:  # the whole pool is free for it and still too small
                    self._leave_queue(seq)
                    self._drop(seq, out)
                    continue
                break
            self._leave_queue(seq)
            if payloads:
                try:
                    self._write_loaded(seq, match, payloads)
                except Exception as exc:  # noqa: BLE001 - its blocks are freed by the engine, uncommitted
                    seq.tier_payloads = None
                    out.failed.append((seq, _tier_failure(exc)))
                    continue
            self._admit(seq, match, cached)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if inflight is not None:
                inflight.update(self._uncommitted_blocks(seq))
        return out

    def _leave_queue(self, seq: Sequence) -> None:
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)

    # ---- one computation per shared prefix ----------------------------------------------
    def _uncommitted_blocks(self, seq: Sequence) -> list:
        """Chain hashes of the prompt's full blocks that ``seq`` has still to compute."""
        hashes = self.kv.hasher(seq).update(seq.prompt_token_ids)
        return hashes[seq.num_computed_tokens // self.kv.block_size :]

    def _inflight_blocks(self) -> set:
        return {h for s in self.running if s.num_computed_tokens < s.num_prompt_tokens
                for h in self._uncommitted_blocks(s)}

    def _next_block_in_flight(self, seq: Sequence, match: MatchResult, inflight: set) -> bool:
        i = match.num_tokens // self.kv.block_size
        if i >= (seq.num_tokens - 1) // self.kv.block_size:  # nothing more it could hit
            return False
        hashes = self.kv.hasher(seq).update(seq.all_token_ids)
        return i < len(hashes) and hashes[i] in inflight

    # ---- storage tiers -------------------------------------------------------------------
    def _tier_payloads(self, seq: Sequence, match: MatchResult) -> list[bytes] | None:
        """Verified KV for the leading tier hits of ``match`` (the longest contiguous run that
        loaded; a failed load ends it and those tokens are computed), or None when the loads
        went to the background (the request waits for them, off the queue)."""
        bs = self.kv.block_size
        first = match.num_tokens // bs
        keys = [h for h, _ in match.tier_hits]
        have = seq.tier_payloads
        if have is not None:  # loaded in the background already
            out = []
            for k in keys:
                if k not in have:
                    break
                out.append(have[k])
            return out
        tiers = [t for _, t in match.tier_hits]
        tokens = [seq.all_token_ids[(first + j) * bs : (first + j + 1) * bs] for j in range(len(keys))]
        if all(self.tiers.is_fast(t) for t in tiers):
            return self.tiers.load_now(keys, tiers, tokens)
        self.loading[seq.request_id] = (seq, keys, self.tiers.submit(keys, tiers, tokens))
        seq.status = SequenceStatus.WAITING_FOR_KV
        return None

    def _poll_loads(self, idle: bool, failed: list | None = None) -> None:
        """Requests whose loads all finished (or passed their deadline) go back to the head of
        the queue. ``idle``: nothing else to run, so wait a little for a load instead of spinning."""
        from ..kv.tiered import wait_any

        if idle:
            futs = [f for _, _, fs in self.loading.values() for f in fs if not f.done()]
            if futs:
                wait_any(futs, min(f.deadline for f in futs))
        now = time.monotonic()
        for rid, (seq, keys, futs) in list(self.loading.items()):
            if all(f.done() or now > f.deadline for f in futs):
                del self.loading[rid]
                try:
                    seq.tier_payloads = self.tiers.collect(keys, futs)
                except Exception as exc:  # noqa: BLE001 - this request alone fails
                    if failed is None:
                        raise
                    failed.append((seq, _tier_failure(exc)))
                    continue
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)

    def _write_loaded(self, seq: Sequence, match: MatchResult, payloads: list[bytes]) -> None:
        table = self.kv.block_table(seq.request_id)
        first = match.num_tokens // self.kv.block_size
        for j, payload in enumerate(payloads):
            key, tier = match.tier_hits[j]
            self.tiers.write_block(table[first + j], key, tier, payload)
            self.tiers.record_hit(tier, self.kv.block_size)
        seq.num_tier_tokens += len(payloads) * self.kv.block_size

    def _admit(self, seq: Sequence, match: MatchResult, cached: int | None = None) -> None:
        cached = match.num_tokens if cached is None else cached
        seq.tier_payloads = None
        self.kv.record_query(seq, match)
        seq.num_computed_tokens = cached
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = cached
        seq.status = SequenceStatus.RUNNING
        self.skips.pop(seq.request_id, None)
        self.running.append(seq)

    def _drop(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.finish(seq, "length")
        out.out_of_memory.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _order_waiting(self) -> None:
        """Longest-prefix-match ordering (SGLang's LPM), bounded so nobody starves.

        Order: (1) starving requests, oldest first: those that ``max_skips`` later arrivals
        have been admitted ahead of; (2) the longest cached prefix; (3) among equal hits,
        requests that share their first block (and namespace) with an older waiting request
        are grouped right behind it, so that one computes the shared prefix and the rest of
        its group then hit it, instead of tenants taking turns and evicting each other's
        prompts; (4) arrival. Above 128 waiting requests the scan costs more than it saves
        and the queue keeps its order (SGLang falls back to FCFS there too).

        Skips are counted from admissions, not from orderings: requests that left the queue
        since the previous call (admitted, or rarely aborted) count against every request
        still waiting that arrived before them.
        """
        if self.config.policy != "lpm":
            return
        previous = self._lpm_previous
        waiting_ids = {s.request_id for s in self.waiting}
        left = sorted(t for rid, t in previous.items() if rid not in waiting_ids)
        for s in self.waiting:
            passed = len(left) - bisect.bisect_right(left, s.arrival_time)
            if passed:
                self.skips[s.request_id] = self.skips.get(s.request_id, 0) + passed
        self._lpm_previous = {s.request_id: s.arrival_time for s in self.waiting}
        if not 2 <= len(self.waiting) <= 128:
            return
        bs = self.kv.block_size
        hit = {s.request_id: self.kv.match_prefix(s).num_tokens for s in self.waiting}
        def group_of(s: Sequence) -> tuple:
            return self.kv.namespace(s.cache_salt, s.adapter_id), tuple(s.all_token_ids[:bs])

        group_arrival: dict[tuple, float] = {}
        for s in sorted(self.waiting, key=lambda s: s.arrival_time):
            group_arrival.setdefault(group_of(s), s.arrival_time)

        def lpm_key(s: Sequence) -> tuple:
            group = group_arrival[group_of(s)]
            return (-hit[s.request_id], group, s.arrival_time)

        limit = self.config.max_skips
        starving = sorted((s for s in self.waiting if self.skips.get(s.request_id, 0) >= limit),
                          key=lambda s: s.arrival_time)
        rest = sorted((s for s in self.waiting if self.skips.get(s.request_id, 0) < limit), key=lpm_key)
        self.waiting = deque(starving + rest)

    # ---- after the model ran -------------------------------------------------------------
    def update(self, out: SchedulerOutput) -> None:
        """Advance progress for the tokens whose KV was written, and index it."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.kv.commit(s.seq, s.seq.num_cacheable_tokens)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        self.kv.free(seq)
