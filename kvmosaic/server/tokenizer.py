"""The tokenizer of a model, without its weights: what a process that runs no engine needs (the
replicas' front, ``kvmosaic explain``, the benchmarks) to count, render and hash prompts as the
engine does.

``tokenizer_for(model)`` reads the tokenizer the engine reads for the same ``--model`` value: the
shipped GGUF when ``model`` is None, a GGUF file's own tokenizer and chat template, or a folder's.
It is the one place that maps a model argument to a tokenizer outside the engine.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=4)
def tokenizer_for(model: str | None):
    """The model's tokenizer (cached per argument: callers share one object; it is only read)."""
    from ..model.loader import shipped_model_path
    from ..model.tokenizer import load_tokenizer

    path = Path(model or shipped_model_path())
    if path.is_file():
        return load_tokenizer(str(path.parent), path.name)
    return load_tokenizer(str(path), None)
