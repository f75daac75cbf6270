"""Compute threads that give way when other work holds the cores.

torch's CPU kernels run OpenMP parallel regions: every GEMM, attention and norm call splits its
work across ``torch.get_num_threads()`` threads and waits for the slowest. When another
process holds one of the cores, the thread scheduled there runs only in the gaps, and every
region waits for it: measured on a 2-core machine, a ~650-token bfloat16 prefill went from
0.26 s to 0.6-8 s with two threads, while one thread took 0.33 s throughout.

:class:`ThreadBudget` reads, before each step, how many threads are runnable on the machine
(``/proc/loadavg``'s ``running`` field, which counts the caller's own thread) and runs the step on
the cores the rest leaves free, between 1 and the configured count; the figure is smoothed over
steps so that a blip does not flip it. The thread count changes no token: kvmosaic's kernels
split work by rows and heads, never inside a sum, and what moves (MKL's float32 GEMM blocks its
sums by thread count) moves log-probabilities by ~1e-6 (``tests/test_threads.py``).
"""

from __future__ import annotations

import os

import torch

LOADAVG = "/proc/loadavg"
# torch's thread count when kvmosaic was imported: an engine's budget without --num-threads (the
# count torch has later may be one a budget set).
DEFAULT_THREADS = torch.get_num_threads()
SMOOTHING = 0.3  # weight of the newest reading in the moving average of other runnable threads


def runnable_threads(path: str = LOADAVG) -> int | None:
    """Threads runnable on the machine right now, the caller included; None where unknown."""
    try:
        with open(path) as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


class ThreadBudget:
    """Sets torch's thread count before each step: ``max_threads`` on a quiet machine, fewer
    while other threads are runnable (at least one)."""

    def __init__(self, max_threads: int, cores: int | None = None, path: str = LOADAVG) -> None:
        self.max_threads = max(1, max_threads)
        self.cores = cores or len(os.sched_getaffinity(0))
        self.path = path
        self.others = 0.0
        self.threads = self.max_threads

    def update(self) -> int:
        """Read the machine's load, set and return the thread count for the next step."""
        running = runnable_threads(self.path)
        if running is not None:
            self.others += SMOOTHING * (max(0, running - 1) - self.others)
        threads = max(1, min(self.max_threads, self.cores - round(self.others)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads
