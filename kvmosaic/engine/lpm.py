"""The waiting queue's order under ``policy="lpm"``: longest prefix match first (SGLang's LPM),
bounded so that nobody starves. docs/ARCHITECTURE.md, "A request's life".

Order: (1) starving requests, oldest first: those that ``max_skips`` later arrivals have been
admitted ahead of; (2) the longest cached prefix; (3) among equal hits, requests that share their
first block (and namespace) with an older waiting request are grouped right behind it, so that one
computes the shared prefix and the rest of its group then hit it, instead of tenants taking turns
and evicting each other's prompts; (4) arrival. Above :data:`MAX_SCAN` waiting requests the scan
costs more than it saves and the queue keeps its order (SGLang falls back to FCFS there too).

Skips are counted from admissions, not from orderings: requests that left the queue since the
previous call (admitted, or rarely aborted) count against every request still waiting that
arrived before them.
"""

from __future__ import annotations

import bisect
from collections import deque

from ..cache.manager import KVCacheManager
from .sequence import Sequence

MAX_SCAN = 128  # waiting requests above which the queue keeps its order


class LongestPrefixOrder:
    def __init__(self, max_skips: int) -> None:
        self.max_skips = max_skips
        self.skips: dict[str, int] = {}  # waiting request -> later arrivals admitted ahead of it
        self._previous: dict[str, float] = {}  # waiting request -> arrival, at the last ordering

    def admitted(self, request_id: str) -> None:
        self.skips.pop(request_id, None)

    def order(self, waiting: deque[Sequence], kv: KVCacheManager) -> deque[Sequence]:
        """``waiting`` in the order above (the same deque where it keeps its order)."""
        ids = {s.request_id for s in waiting}
        left = sorted(t for rid, t in self._previous.items() if rid not in ids)
        for s in waiting:
            passed = len(left) - bisect.bisect_right(left, s.arrival_time)
            if passed:
                self.skips[s.request_id] = self.skips.get(s.request_id, 0) + passed
        self._previous = {s.request_id: s.arrival_time for s in waiting}
        if not 2 <= len(waiting) <= MAX_SCAN:
            return waiting
        bs = kv.block_size
        hit = {s.request_id: kv.match_prefix(s).num_tokens for s in waiting}

        def group_of(s: Sequence) -> tuple:
            return kv.request_namespace(s), tuple(s.all_token_ids[:bs])

        group_arrival: dict[tuple, float] = {}
        for s in sorted(waiting, key=lambda s: s.arrival_time):
            group_arrival.setdefault(group_of(s), s.arrival_time)

        def key(s: Sequence) -> tuple:
            return -hit[s.request_id], group_arrival[group_of(s)], s.arrival_time

        starving = sorted((s for s in waiting if self.skips.get(s.request_id, 0) >= self.max_skips),
                          key=lambda s: s.arrival_time)
        rest = sorted((s for s in waiting if self.skips.get(s.request_id, 0) < self.max_skips), key=key)
        return deque(starving + rest)
