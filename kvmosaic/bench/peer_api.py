"""What every peer shares: its settings, one generation's timings, and the clock they use.
A leaf module, so the peers and the registry in ``peers.py`` import it without a circle."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Generation:
    token_ids: list[int]
    ttft: float
    e2e: float
    cached_tokens: int


@dataclass
class PeerSettings:
    dtype: str = "bfloat16"
    threads: int | None = None
    model_path: str | None = None  # None: the shipped GGUF


def clock() -> float:
    return time.perf_counter()
