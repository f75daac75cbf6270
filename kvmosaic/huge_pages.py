"""Transparent huge pages for the engine's large CPU tensors (docs/ARCHITECTURE.md, "Devices").

A decode step streams every weight once (~270 MB for the shipped model in bfloat16) and the
context's K and V; on 4 KB pages that is a TLB miss every 4 KB. torch's CPU allocator backs each
allocation of 2 MB or more with transparent huge pages (``madvise(MADV_HUGEPAGE)``) when
``THP_MEM_ALLOC_ENABLE=1``; it is off by default. Measured on a 2-core Zen 5 EPYC (BENCHMARKS.md,
nineteenth session): a bfloat16 batch-1 step 5.5 -> 5.0 ms in fast-memory minutes (the LM head's
56 MB then read at ~100% of the bandwidth reading), within noise in slow ones; a 32-sequence
step's decode attention 3-7% faster; prefill unchanged.

Invariant: torch reads the variable once, at its first allocation of 2 MB or more in the process
(importing the engine's modules makes one), so ``kvmosaic/__init__.py`` asks when the package is
first imported, before anything else of it loads; an operator's own value (``0`` to opt out) is
kept, and a process that allocated large tensors before importing kvmosaic keeps 4 KB pages
(correct, only slower). Pages never change a result: the same bits either way.
"""

from __future__ import annotations

import os

ENV = "THP_MEM_ALLOC_ENABLE"


def request_huge_pages() -> None:
    """Asks torch's CPU allocator for huge pages on large allocations, unless the operator chose."""
    os.environ.setdefault(ENV, "1")

