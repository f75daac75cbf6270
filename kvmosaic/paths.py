"""Where kvmosaic keeps what it builds once per machine and reuses at every start (compiled
kernels, converted tokenizers, GGUF indexes, the benchmarks' exports)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str, env: str) -> Path:
    """``$env`` when set and not empty, else ``~/.cache/kvmosaic/<name>``. Raises RuntimeError when
    there is no home folder to find."""
    return Path(os.environ.get(env) or Path.home() / ".cache" / "kvmosaic" / name)
