"""Automatic reuse turned off for a namespace whose audited answers drift (issue 24;
docs/ARCHITECTURE.md, "Automatic segment reuse").

The shadow audit (``shadow.py``) measures a sample of the answers from reused KV. With a trip share
set (``auto_reuse_audit_trip``), a namespace (cache salt and adapter: whose chunks may be reused for
whom) whose last :data:`TRIP_WINDOW` audited answers hold more than that share over the bound, once
it has at least :data:`TRIP_MIN` of them, gets no automatic reuse for :data:`TRIP_HOLD_S` seconds:
its prompts run as ordinary prefills (exact; prefix caching is unaffected, and its chunks are still
stored). Then it is judged afresh, from new audits. The per-request guard bounds an estimate; this
bounds, per tenant, what the audits measured.

Invariant: a namespace that is off is never answered from automatically reused KV until its hold
ends; no namespace is judged on another's audits.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable

TRIP_WINDOW = 20  # the last audited answers a namespace is judged on
TRIP_MIN = 10  # audited answers it needs in that window before it can trip
TRIP_HOLD_S = 600.0  # how long automatic reuse stays off once it tripped
MAX_NAMESPACES = 4096  # namespaces whose recent audits are kept (least recently audited dropped first)


class DriftBreaker:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._recent: OrderedDict[Hashable, deque[bool]] = OrderedDict()  # namespace -> over the bound?
        self._off_until: dict[Hashable, float] = {}
        self.trips = 0

    def record(self, namespace: Hashable, over: bool, share: float | None) -> bool:
        """One audited answer of ``namespace``; ``share``: the trip share (None: never trip). Returns
        whether this answer tripped it."""
        if share is None:
            return False
        window = self._recent.pop(namespace, None) or deque(maxlen=TRIP_WINDOW)
        self._recent[namespace] = window  # most recently audited last
        if len(self._recent) > MAX_NAMESPACES:
            self._recent.popitem(last=False)
        window.append(over)
        if len(window) < TRIP_MIN or sum(window) <= share * len(window):
            return False
        self._off_until[namespace] = self.clock() + TRIP_HOLD_S
        window.clear()
        self.trips += 1
        return True

    def off(self, namespace: Hashable) -> bool:
        """Whether automatic reuse is off for ``namespace`` now."""
        until = self._off_until.get(namespace)
        if until is not None and self.clock() >= until:
            del self._off_until[namespace]
            return False
        return until is not None

    @property
    def num_off(self) -> int:
        """Namespaces off now."""
        now = self.clock()
        return sum(until > now for until in self._off_until.values())
