"""Fair share between tenants: one tenant's flood delays itself, not the others.

The scheduler's token budget per step and its running slots are shared by weighted fair
queuing over *service*: the tokens each tenant had computed, decayed per step (a tenant idle
for a while starts again at the front). Each step:

* running sequences: decodes first (one token each: cheap, and every stream advances), then
  prefill chunks, the least-served tenant's first; a preemption, which takes the last of this
  order, so falls on the most-served tenant; running prefills leave part of the budget
  (:meth:`FairShare.reserve`) to waiting requests of less-served tenants;
* newcomers: a waiting request of a tenant that has nothing running and was served less than
  every tenant running gets a step of its own (:meth:`newcomers`; never two in a row), so its
  first token waits for the step in progress and its own prefill, not for another tenant's
  decodes and prefill chunks;
* while several tenants are active (running, waiting, or served in the last few hundred steps),
  the most-served tenant's prefill tokens per step are capped (:meth:`chunk_caps`,
  ``fair_chunk_tokens``), and so are its decodes (``fair_decode_rows``), taken in turn: decodes
  run least recently advanced first (``Sequence.last_step``), so one skipped goes first next
  step and none starves. The step in progress when a newcomer arrives is short: a tenant's 64
  decodes over long contexts read gigabytes of KV a step;
* waiting sequences: the least-served tenant's first (the queue's own order kept within a
  tenant), and a tenant already holding its share of the running slots
  (``ceil(max_num_seqs / active tenants)``) waits while another tenant has a request waiting;
  a tenant under its share may take a slot past ``max_num_seqs`` (one per other tenant).

A request's tenant is ``Sequence.tenant`` (the server sets it from the API key; None: one
shared class). With a single tenant nothing is reordered, so the FCFS/LPM behaviour and its
tests stand unchanged. docs/ARCHITECTURE.md ("A request's life", step 4).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .sequence import Sequence


class FairShare:
    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.served: dict[str | None, float] = {}
        self.step = 0  # steps scheduled so far (Sequence.last_step counts in them)

    def charge(self, seq: Sequence, tokens: int) -> None:
        self.served[seq.tenant] = self.served.get(seq.tenant, 0.0) + tokens

    def end_step(self) -> None:
        self.step += 1
        self.served = {t: v * self.decay for t, v in self.served.items() if v * self.decay >= 1.0}

    @staticmethod
    def tenants(*groups: Iterable[Sequence]) -> set[str | None]:
        return {s.tenant for g in groups for s in g}

    def order_running(self, running: list[Sequence], in_turn: bool = False) -> list[Sequence]:
        """Decodes (least recently advanced first), then prefills (least-served tenant first);
        with one tenant running the batch's own order, unless decodes are capped (``in_turn``)."""
        if len(self.tenants(running)) < 2 and not in_turn:
            return list(running)
        decodes = sorted((s for s in running if s.num_uncomputed <= 1), key=lambda s: s.last_step)
        prefills = [s for s in running if s.num_uncomputed > 1]
        return decodes + sorted(prefills, key=lambda s: self.served.get(s.tenant, 0.0))

    def reserve(self, running: list[Sequence], waiting: Iterable[Sequence], budget: int) -> int:
        """Tokens of this step's budget kept from running prefills for waiting requests of tenants
        served less than the most-served tenant prefilling now (at most half the budget), so a
        newcomer is not queued behind another tenant's long prompts being chunked in."""
        prefilling = {s.tenant for s in running if s.num_uncomputed > 1}
        if not prefilling:
            return 0
        top = max(self.served.get(t, 0.0) for t in prefilling)
        want = sum(s.num_tokens for s in waiting
                   if s.tenant not in prefilling or self.served.get(s.tenant, 0.0) < top)
        return min(budget // 2, want) if len(prefilling | {s.tenant for s in waiting}) > 1 else 0

    def newcomers(self, running: list[Sequence], waiting: Iterable[Sequence]) -> list[Sequence]:
        """Waiting requests, in queue order, of tenants with nothing running and served less than
        every tenant running now (with one tenant, or nothing running: none)."""
        if not running:
            return []
        busy = self.tenants(running)
        floor = min(self.served.get(t, 0.0) for t in busy)
        return [s for s in waiting if s.tenant not in busy and self.served.get(s.tenant, 0.0) < floor]

    def chunk_caps(self, running: list[Sequence], waiting: Iterable[Sequence], chunk: int) -> dict[str | None, int]:
        """What this step may give each capped tenant (prefill tokens, or decode rows): ``chunk``
        for the most-served tenant(s) while another tenant is active (running, waiting, or served
        recently: its decayed service is at least one token); ``{}`` (no cap) otherwise, or when
        ``chunk`` is 0."""
        if chunk <= 0:
            return {}
        active = self.tenants(running, waiting) | set(self.served)
        if len(active) < 2:
            return {}
        top = max(self.served.get(t, 0.0) for t in active)
        return {t: chunk for t in active if self.served.get(t, 0.0) >= top}

    def order_waiting(self, waiting: list[Sequence]) -> list[Sequence]:
        if len(self.tenants(waiting)) < 2:
            return list(waiting)
        return sorted(waiting, key=lambda s: self.served.get(s.tenant, 0.0))  # stable: queue order kept

    def may_exceed(self, seq: Sequence, running: list[Sequence], max_num_seqs: int) -> bool:
        """The slots are full, but ``seq``'s tenant holds less than its share of them: it may run
        beyond ``max_num_seqs`` (by at most one slot per other tenant), instead of waiting for
        another tenant's requests to finish."""
        active = self.tenants(running) | {seq.tenant}
        if len(active) < 2 or len(running) >= max_num_seqs + len(active) - 1:
            return False
        return sum(s.tenant == seq.tenant for s in running) < math.ceil(max_num_seqs / len(active))

    def over_share(self, seq: Sequence, running: list[Sequence], waiting: Iterable[Sequence],
                   max_num_seqs: int) -> bool:
        """``seq``'s tenant holds its share of the running slots while another tenant waits."""
        others_waiting = any(s.tenant != seq.tenant for s in waiting)
        if not others_waiting:
            return False
        active = self.tenants(running, waiting)
        share = math.ceil(max_num_seqs / max(1, len(active)))
        return sum(s.tenant == seq.tenant for s in running) >= share
