"""Compute threads that give way when other work holds the cores.

torch's CPU kernels run OpenMP parallel regions: every GEMM, attention and norm call splits its
work across ``torch.get_num_threads()`` threads and waits for the slowest. When another
process holds one of the cores, the thread scheduled there runs only in the gaps, and every
region waits for it: measured on a 2-core machine, a ~650-token bfloat16 prefill went from
0.26 s to 0.6-8 s with two threads, while one thread took 0.33 s throughout.

:class:`ThreadBudget` measures, over the last fraction of a second, how many cores the rest of
the machine kept busy: all CPUs' busy time (``/proc/stat``) less this process's own CPU time
(its OpenMP workers spinning included). Before each step it runs torch on the cores that leaves
free, between 1 and the configured count. A core is given up only while others use most of one
(:data:`TAKEN`): a client streaming the answers, busy a millisecond per token, is not a reason.

The thread count changes no token: kvmosaic's kernels split work by rows and heads, never
inside a sum, and what moves (MKL's float32 GEMM blocks its sums by thread count) moves
log-probabilities by ~1e-6 (``tests/test_threads.py``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch

PROC_STAT = "/proc/stat"
WINDOW = 0.25  # seconds between two readings of the machine's CPU time
SMOOTHING = 0.5  # weight of the newest window in the moving average of others' cores
TAKEN = 0.6  # others' average use of a core from which that core counts as taken
# torch's thread count when kvmosaic was imported: an engine's budget without --num-threads (the
# count torch has later may be one a budget set).
DEFAULT_THREADS = torch.get_num_threads()


def machine_busy_seconds(path: str = PROC_STAT) -> float | None:
    """CPU seconds all CPUs spent busy since boot (``/proc/stat``); None where unknown."""
    try:
        with open(path) as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process's CPU seconds, every thread's."""
    t = os.times()
    return t.user + t.system


class ThreadBudget:
    """Sets torch's thread count before each step: ``max_threads`` on a quiet machine, one
    fewer for each core other processes keep busy (at least one)."""

    def __init__(self, max_threads: int, cores: int | None = None, path: str = PROC_STAT,
                 clock: Callable[[], float] = time.monotonic,
                 own_cpu: Callable[[], float] = own_cpu_seconds) -> None:
        self.max_threads = max(1, max_threads)
        self.cores = cores or len(os.sched_getaffinity(0))
        self.path, self.clock, self.own_cpu = path, clock, own_cpu
        self.others = 0.0  # cores the rest of the machine keeps busy, smoothed
        self.threads = self.max_threads
        self._last = self._reading()

    def _reading(self) -> tuple[float, float, float] | None:
        busy = machine_busy_seconds(self.path)
        return None if busy is None else (self.clock(), busy, self.own_cpu())

    def update(self) -> int:
        """Every :data:`WINDOW` seconds, measure the others' cores; set and return the thread
        count for the next step."""
        if self._last is None or self.clock() - self._last[0] < WINDOW:
            return self.threads
        now = self._reading()
        if now is None:
            return self.threads
        wall, busy, own = (b - a for a, b in zip(self._last, now))
        self._last = now
        self.others += SMOOTHING * (max(0.0, (busy - own) / wall) - self.others)
        taken = math.floor(self.others + (1 - TAKEN))
        threads = max(1, min(self.max_threads, self.cores - taken))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads
