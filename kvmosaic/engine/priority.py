"""Priority scheduling (``scheduling_policy="priority"``): the more important request first, at
every choice the scheduler makes. docs/ARCHITECTURE.md, "A request's life".

A request's importance is its ``Sequence.priority`` (higher first: SGLang's convention, and the
"priority" eviction policy's), then its arrival (earlier first). The OpenAI server reads vLLM's
``priority`` field, where lower comes first, and negates it (server/serving.py).

* the waiting queue is kept in importance order (a preempted request goes back to its place);
* running requests claim the step's budget and blocks in importance order, so when the pool runs
  out the least important one not yet scheduled is preempted (vLLM's rule under its priority
  policy; FCFS preempts the newest);
* a waiting request that outranks the least important running one and cannot be admitted (the
  running slots are full, or the pool lacks the blocks of its first chunk) preempts it before the
  step is built (SGLang's priority preemption), so that it starts at this step.

Within one priority the order of the other policies (arrival, fair share between tenants) stands:
every sort here is stable.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


def importance(seq: Sequence) -> tuple[int, float]:
    """Larger is more important: priority, then the earlier arrival."""
    return seq.priority, -seq.arrival_time


def order_waiting(waiting: deque[Sequence]) -> deque[Sequence]:
    """The queue, most important first."""
    return deque(sorted(waiting, key=importance, reverse=True))


def most_important_first(seqs: list[Sequence]) -> list[Sequence]:
    """``seqs`` by priority, their order kept within one priority."""
    return sorted(seqs, key=lambda s: -s.priority)


def least_important(seqs: list[Sequence]) -> Sequence:
    return min(seqs, key=importance)
