"""Anticipation: hold the next step a few milliseconds for a tenant that sends one request at a time.

A client that waits for each answer before sending its next request (a chat session, an agent's
tool loop) looks idle between its requests: its last token goes out, the engine starts the next
step for the other tenants at once, and the client's next request, arriving a millisecond later,
waits for the whole of that step. This is *deceptive idleness* (Iyer and Druschel, "Anticipatory
scheduling", SOSP 2001; Linux's anticipatory I/O scheduler): a work-conserving scheduler hands the
resource away just before the synchronous client comes back. The cure is theirs: after such a
tenant's last request leaves, hold the next step for a short window if that tenant has been
coming back within it.

Invariants:

* a hold happens only while another tenant has work (the engine would otherwise idle anyway),
  for a tenant served less than a tenant running now (its newcomer gets a step of its own,
  engine/fair_share.py), whose last ``think`` time (from its last request leaving to its next
  arriving, an average over its recent requests) is under the window;
* one hold per idle period, never longer than ``window`` seconds from the moment the tenant went
  idle; a tenant that comes back later than that (or never) raises its average and stops being
  waited for;
* with one tenant, or ``window`` 0, nothing is ever held.

docs/ARCHITECTURE.md ("A request's life", step 4).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

SMOOTHING = 0.25  # weight of the newest think time in a tenant's average
LONG = 10  # a think time is counted at most this many windows (a tenant idle longer is dropped)


class Anticipation:
    def __init__(self, window: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.window = window
        self.clock = clock
        self.idle_since: dict[str | None, float] = {}  # tenant -> when its last request left
        self.think: dict[str | None, float] = {}  # tenant -> average seconds from idle to its next request
        self.holds = 0  # idle periods held for
        self.hits = 0  # of those, the tenant came back inside the window
        self.held_seconds = 0.0  # time the engine waited in holds (what the other tenants paid)
        self._held: set[str | None] = set()  # tenants whose present idle period was held for

    def went_idle(self, tenant: str | None) -> None:
        """``tenant``'s last request (running, waiting or loading) has left the engine."""
        if self.window > 0:
            self.idle_since[tenant] = self.clock()
            self._held.discard(tenant)

    def arrived(self, tenant: str | None, at: float) -> None:
        """A request of ``tenant`` was queued; it reached the server at ``at`` (the clock's time:
        a request that came during a step is queued after it, and its think time ends at ``at``)."""
        since = self.idle_since.pop(tenant, None)
        if since is None:
            return
        gap = min(max(0.0, at - since), LONG * self.window)
        if tenant in self._held and gap <= self.window:
            self.hits += 1
        self._learn(tenant, gap)

    def hold(self, busy: Iterable[str | None], served: dict[str | None, float]) -> float:
        """Seconds to hold the next step (0: none) while the tenants ``busy`` have work;
        ``served``: each tenant's decayed service (FairShare.served)."""
        busy = set(busy)
        if not self.idle_since or not busy:
            return 0.0
        now = self.clock()
        for tenant in [t for t, since in self.idle_since.items() if now - since >= LONG * self.window]:
            del self.idle_since[tenant]  # gone for long: learned as such now, so the map stays small
            self._learn(tenant, LONG * self.window)
        floor = min(served.get(t, 0.0) for t in busy)
        wait = 0.0
        for tenant, since in self.idle_since.items():
            deadline = self._deadline(tenant, since)
            if deadline is None or deadline <= now or tenant in busy or served.get(tenant, 0.0) >= floor:
                continue
            if tenant not in self._held:
                self._held.add(tenant)
                self.holds += 1
            wait = max(wait, deadline - now)
        return wait

    def waited(self, seconds: float) -> None:
        """The engine held its next step for ``seconds``."""
        self.held_seconds += seconds

    def _learn(self, tenant: str | None, gap: float) -> None:
        self._held.discard(tenant)
        old = self.think.get(tenant)
        self.think[tenant] = gap if old is None else (1 - SMOOTHING) * old + SMOOTHING * gap

    def _deadline(self, tenant: str | None, since: float) -> float | None:
        """When the hold for ``tenant``'s idle period that began at ``since`` ends, or None when
        the tenant is not waited for (no think time known yet, or it is over the window)."""
        think = self.think.get(tenant)
        if think is None or think > self.window:
            return None
        return since + self.window
