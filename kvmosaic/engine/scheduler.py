"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget (``max_num_batched_tokens``):

1. running sequences first, oldest first: one token for a decode, the next chunk for a
   prefill in progress. When the pool has no block for one, the newest running sequence is
   preempted (its blocks freed, its progress reset; it goes back to the head of the queue
   and recomputes, usually hitting its own cached blocks); under policy "priority" the
   order is the requests' importance, and the least important is preempted
   (engine/priority.py);
2. then waiting sequences are admitted while budget, sequence slots and blocks last, each
   starting after its cached prefix. New prefills thus join running decodes.

While any request is decoding, a step's prompt tokens are what the engine computes in
``max_decode_stall_ms`` at most (engine/pace.py). A waiting sequence whose next uncached block
another is computing waits for it, then hits it (engine/inflight.py). The runner writes the
scheduled tokens' KV; only then does :meth:`Scheduler.update` advance progress and index blocks.

Storage tiers: the scheduler owns a tier connector (kvmosaic/kv/connector.py; None: no tiers) and
does no tier I/O itself: it asks what the tiers supply past the pool's match, parks a request whose
load runs in the background in ``WAITING_FOR_KV`` and tells the connector what it allocated and
when a request ends (docs/ARCHITECTURE.md, "Storage tiers"); a question that raises fails that
request alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..cache.lens import CacheLens
from ..cache.manager import KVCacheManager, MatchResult
from ..kv.connector import KVConnector
from .anticipation import Anticipation
from .fair_share import FairShare
from .inflight import inflight_blocks, next_block_in_flight, uncommitted_blocks
from .lpm import LongestPrefixOrder
from .pace import PrefillPace
from .priority import least_important, most_important_first, order_waiting
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from .scored_prefix import ScoredPrefixCache


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 8192
    # "fcfs", "lpm" (longest cached prefix first) or "priority" (engine/priority.py)
    policy: str = "fcfs"
    max_skips: int = 8  # lpm: how many times a waiting request may be passed over
    # While several tenants are active, the prefill tokens a step gives the most-served tenant at
    # most (FairShare.chunk_caps); 0: no limit.
    fair_chunk_tokens: int = 0
    # ... and the decodes a step gives it at most, in turn (FairShare.order_running); 0: no limit.
    fair_decode_rows: int = 0
    # Seconds the next step may wait for a tenant that sends one request at a time to send its
    # next (engine/anticipation.py); 0: never.
    fair_anticipation: float = 0.0
    # While any request is decoding, a step computes the prompt tokens this engine computes in
    # this many milliseconds at most (engine/pace.py); 0: the token budget alone.
    max_decode_stall_ms: float = 0.0


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
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, connector: KVConnector | None = None,
                 lens: CacheLens | None = None) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.lpm = LongestPrefixOrder(config.max_skips)  # the waiting queue's order under policy "lpm"
        # Storage tiers (None: off), and the requests in WAITING_FOR_KV: request id -> sequence.
        self.connector = connector
        self.fair = FairShare()  # tenants share the step budget and the slots (engine/fair_share.py)
        self._express_last = False  # the last step was newcomers' alone (FairShare.newcomers)
        self.anticipation = Anticipation(config.fair_anticipation)
        self.pace = PrefillPace(config.max_decode_stall_ms)  # the engine tells it each step's time
        self.loading: dict[str, Sequence] = {}
        # Live miss reasons and per-tenant figures (cache/lens.py; None: off), told of each admission.
        self.lens = lens
        self.scored: ScoredPrefixCache | None = None  # a scored prompt's cached prefix (engine/scored_prefix.py)

    def add(self, seq: Sequence) -> None:
        self.anticipation.arrived(seq.tenant, seq.arrival_time)
        self.waiting.append(seq)

    def hold(self) -> float:
        """Seconds to hold the next step for a one-request-at-a-time tenant's next request
        (engine/anticipation.py); 0: step now."""
        if not self.anticipation.idle_since:  # the common case, checked before any scan: every step asks
            return 0.0
        return self.anticipation.hold(self.fair.tenants(self.running, self.waiting), self.fair.served)

    def _left(self, seq: Sequence) -> None:
        """``seq`` left the engine: when it was its tenant's last, the tenant went idle."""
        if self.anticipation.window <= 0:  # off: no scan on every finish
            return
        groups = (self.running, self.waiting, self.loading.values())
        if not any(s.tenant == seq.tenant for group in groups for s in group):
            self.anticipation.went_idle(seq.tenant)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            seq = next((s for s in queue if s.request_id == request_id), None)
            if seq is not None:
                queue.remove(seq)
                break
        else:
            seq = self.loading.pop(request_id, None)
        if seq is not None:
            self._release(seq)
            self._left(seq)
        return seq

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """``child`` (the parent's prompt, nothing generated) joins the running batch holding the
        KV of the parent's computed tokens (``KVCacheManager.fork``: full blocks shared, the
        partial one copied), so it computes none of them. False, changing nothing, when the pool
        has no block for the copy, or the running batch is full (``max_num_seqs``): the caller
        queues the child as a new request instead, which hits the prefix cache."""
        n = parent.num_computed_tokens
        if len(self.running) >= self.config.max_num_seqs or not self.kv.fork(parent, child, n):
            return False
        child.num_computed_tokens = n
        child.num_cached_tokens = n
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        return True

    def _release(self, seq: Sequence) -> None:
        """Free a request's blocks, the connector told first (its loads cancelled)."""
        if self.connector is not None:
            self.connector.request_finished(seq, self.kv.block_table(seq.request_id))
        self.kv.free(seq)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        prefill = self._prefill_allowance()
        if self._express_step(out, prefill):
            return out
        by_priority = self.config.policy == "priority"
        if by_priority:
            self.waiting = order_waiting(self.waiting)
            self._preempt_for_waiting(out)
        outranked = len(out.preempted)
        budget = self.config.max_num_batched_tokens
        caps = self.fair.chunk_caps(self.running, self.waiting, self.config.fair_chunk_tokens)
        rows = self.fair.chunk_caps(self.running, self.waiting, self.config.fair_decode_rows)
        reserved = self.fair.reserve(self.running, self.waiting, budget)  # for other tenants' newcomers
        queue = self.fair.order_running(self.running, in_turn=bool(rows))
        if by_priority:  # the last of the queue, the first preempted, is then the least important
            queue = most_important_first(queue)
        while queue and budget > 0:
            seq = queue.pop(0)
            decode = seq.num_uncomputed <= 1
            n = min(seq.num_uncomputed, budget if decode else
                    min(budget - reserved, caps.get(seq.tenant, budget), prefill))
            if n <= 0:
                continue
            if decode and seq.tenant in rows:  # a capped tenant's decode
                if rows[seq.tenant] <= 0:
                    continue  # its turn comes next step (FairShare.order_running)
                rows[seq.tenant] -= 1
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
                self.fair.charge(seq, n)
                seq.last_step = self.fair.step
                budget -= n
                if not decode:
                    prefill -= n
                if n > 1 and seq.tenant in caps:
                    caps[seq.tenant] -= n
        if self.loading:
            self._poll_loads(idle=not out.scheduled and not self.waiting, failed=out.failed)
        if len(out.preempted) > outranked or out.out_of_memory:  # the pool is short: admit nobody
            self.fair.end_step()
            return out
        if self.config.policy == "lpm":
            self.waiting = self.lpm.order(self.waiting, self.kv)
        candidates = self.fair.order_waiting(list(self.waiting))
        if by_priority:
            candidates = most_important_first(candidates)
        self._admit_waiting(candidates, min(budget, prefill), caps, out)
        self.fair.end_step()
        return out

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Policy "priority": the least important running request is preempted while the most important
        waiting one outranks it and could not be admitted (engine/priority.py)."""
        if not self.waiting or not self.running:
            return
        top = self.waiting[0]
        match = self._match(top)
        first = min(top.num_tokens - match.num_tokens, self.config.max_num_batched_tokens)
        need = self.kv.num_blocks_needed(top, match.num_tokens + first, match)
        if need > self.kv.pool.num_blocks:  # no preemption would make room for it
            return
        while self.running:
            victim = least_important(self.running)
            if victim.priority >= top.priority:
                return
            if len(self.running) < self.config.max_num_seqs and self.kv.make_room(need):
                return
            self._preempt(victim)
            out.preempted.append(victim)
            self.waiting = order_waiting(self.waiting)

    def decode_allowance(self) -> int | None:
        """Prompt tokens a step may compute beside the requests decoding now: what the engine computes
        in ``max_decode_stall_ms`` (engine/pace.py); None when none is decoding or no target is set."""
        allowance = self.pace.allowance()
        if allowance is None or not any(s.num_uncomputed <= 1 for s in self.running):
            return None
        return allowance

    def _prefill_allowance(self) -> int:
        """Prompt tokens this step may compute: :meth:`decode_allowance`, else the whole token budget."""
        budget = self.config.max_num_batched_tokens
        allowance = self.decode_allowance()
        return budget if allowance is None else min(budget, allowance)

    def _express_step(self, out: SchedulerOutput, prefill: int) -> bool:
        """A step of its own for newcomers of tenants served less than everyone running
        (:meth:`FairShare.newcomers`): their first token does not wait behind the running
        batch's decodes and prefill chunks. Never two such steps in a row, so the running
        sequences advance at least every other step; ``prefill``: the prompt tokens it may
        compute (:meth:`_prefill_allowance`). False, scheduling nothing, when there is none or
        none could be admitted."""
        newcomers = [] if self._express_last else self.fair.newcomers(self.running, self.waiting)
        self._express_last = False
        if not newcomers:
            return False
        self._admit_waiting(newcomers, prefill, {}, out)
        if not (out.scheduled or out.failed or out.out_of_memory or self.loading):
            return False
        self._express_last = True
        self.fair.end_step()
        return True

    def _admit_waiting(self, candidates: list[Sequence], budget: int, caps: dict, out: SchedulerOutput) -> None:
        """Admit ``candidates`` (waiting sequences, in order) while budget, slots and blocks
        last, each starting after its cached prefix (pool, then tiers)."""
        inflight = inflight_blocks(self.kv, self.running) if self.kv.enable_caching else None
        for seq in candidates:
            if budget <= 0:
                break
            if len(self.running) >= self.config.max_num_seqs and \
                    not self.fair.may_exceed(seq, self.running, self.config.max_num_seqs):
                break
            if self.fair.over_share(seq, self.running, self.waiting, self.config.max_num_seqs):
                continue  # its tenant holds its share of the slots while another tenant waits
            if caps.get(seq.tenant, 1) <= 0:
                continue  # its tenant had its prefill tokens of this step (FairShare.chunk_caps)
            match = self._match(seq)
            if inflight and (seq.reads_cache or self.scored) and next_block_in_flight(self.kv, seq, match, inflight):
                continue  # another sequence is computing it: hit it at a later step
            external = 0
            if self.connector is not None:  # nothing to load past an empty match
                try:
                    external, load_async = self.connector.get_num_new_matched_tokens(seq, match)
                except Exception as exc:  # noqa: BLE001 - a tier load fails this request alone
                    self._leave_queue(seq)
                    out.failed.append((seq, _tier_failure(exc)))
                    continue
                if load_async:  # loading in the background: the others go on
                    self._leave_queue(seq)
                    seq.status = SequenceStatus.WAITING_FOR_KV
                    self.loading[seq.request_id] = seq
                    continue
            cached = match.num_tokens + external
            n = min(seq.num_tokens - cached, budget, caps.get(seq.tenant, budget))
            table = self.kv.allocate_slots(seq, cached + n, match)
            if table is None:
                if not self.running:  # the whole pool is free for it and still too small
                    self._leave_queue(seq)
                    self._drop(seq, out)
                    continue
                break
            self._leave_queue(seq)
            if self.connector is not None:
                try:
                    self.connector.update_state_after_alloc(seq, table, external)
                except Exception as exc:  # noqa: BLE001 - its blocks are freed by the engine, uncommitted
                    out.failed.append((seq, _tier_failure(exc)))
                    continue
                seq.num_tier_tokens += external
            self._admit(seq, match, cached)
            out.scheduled.append(ScheduledSeq(seq, n))
            self.fair.charge(seq, n)
            budget -= n
            if seq.tenant in caps:
                caps[seq.tenant] -= n
            if inflight is not None:
                inflight.update(uncommitted_blocks(self.kv, seq))

    def _match(self, seq: Sequence) -> MatchResult:
        """The prefix ``seq`` starts after: the pool's; a scored prompt's, where its rows are kept."""
        if seq.reads_cache:
            return self.kv.match_prefix(seq)
        return self.scored.match(seq) if self.scored is not None else MatchResult()

    def _leave_queue(self, seq: Sequence) -> None:
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)

    # ---- storage tiers -------------------------------------------------------------------
    def _poll_loads(self, idle: bool, failed: list) -> None:
        """Requests whose background loads all finished (or passed their deadline) go back to
        the head of the queue; one whose collection raised fails alone. ``idle``: nothing else
        to run, so the connector waits a little for a load instead of spinning."""
        for rid, exc in self.connector.get_finished(wait=idle):
            seq = self.loading.pop(rid, None)
            if seq is None:
                continue
            if exc is not None:
                failed.append((seq, _tier_failure(exc)))
                continue
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _admit(self, seq: Sequence, match: MatchResult, cached: int | None = None) -> None:
        cached = match.num_tokens if cached is None else cached
        if seq.reads_cache:  # one that cannot read the cache is no query of it (vLLM's rule)
            self.kv.record_query(seq, match)
            if self.lens is not None:
                self.lens.on_admit(seq, match, cached)
        if not seq.reads_cache and match.blocks:
            seq.prefix_hidden = self.scored.prefix_rows(match.blocks)
        seq.num_computed_tokens = cached
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = cached
        seq.status = SequenceStatus.RUNNING
        self.lpm.admitted(seq.request_id)
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
        self._release(seq)
        self._left(seq)
