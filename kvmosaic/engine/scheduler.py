"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget (``max_num_batched_tokens``):

1. running sequences first, oldest first: one token for a decode, the next chunk for a
   prefill in progress. When the pool has no block for one, the newest running sequence is
   preempted (its blocks freed, its progress reset; it goes back to the head of the queue
   and recomputes, usually hitting its own cached blocks);
2. then waiting sequences are admitted while budget, sequence slots and blocks last, each
   starting after its cached prefix. New prefills thus join running decodes.

A sequence's KV for the scheduled tokens is written by the model runner; only after that
does :meth:`Scheduler.update` advance progress and let the cache index the new blocks.
"""

from __future__ import annotations

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

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.skips: dict[str, int] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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
        return None

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        queue = list(self.running)
        scheduled_ids: set[str] = set()
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed, budget)
            while self.kv.allocate_slots(seq, seq.num_computed_tokens + n) is None:
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                scheduled_ids.add(seq.request_id)
                budget -= n
        if out.preempted:
            return out
        self._order_waiting()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            match = self.kv.match_prefix(seq)
            n = min(seq.num_tokens - match.num_tokens, budget)
            if self.kv.allocate_slots(seq, match.num_tokens + n, match) is None:
                break
            self.waiting.popleft()
            self._admit(seq, match)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _admit(self, seq: Sequence, match: MatchResult) -> None:
        self.kv.record_query(seq, match)
        seq.num_computed_tokens = match.num_tokens
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = match.num_tokens
        seq.status = SequenceStatus.RUNNING
        self.skips.pop(seq.request_id, None)
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _order_waiting(self) -> None:
        """Longest-prefix-match ordering (SGLang's LPM), bounded so nobody starves: a request
        passed over ``max_skips`` times goes first."""
        if self.config.policy != "lpm" or len(self.waiting) < 2:
            return
        starving = [s for s in self.waiting if self.skips.get(s.request_id, 0) >= self.config.max_skips]
        rest = [s for s in self.waiting if self.skips.get(s.request_id, 0) < self.config.max_skips]
        rest.sort(key=lambda s: -self.kv.match_prefix(s).num_tokens)  # stable: FCFS among ties
        ordered = starving + rest
        for pos, s in enumerate(ordered):
            if any(o.arrival_time > s.arrival_time for o in ordered[:pos]):
                self.skips[s.request_id] = self.skips.get(s.request_id, 0) + 1
        self.waiting = deque(ordered)

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
