"""The tokenizer of a model, without its weights: what a process that runs no engine needs (the
replicas' front, ``kvmosaic explain``, the benchmarks) to count, render and hash prompts as the
engine does.

``tokenizer_for(model, chat_template)`` reads the tokenizer the engine reads for the same
``--model`` and ``--chat-template`` values: the shipped GGUF when ``model`` is None, a GGUF file's
own tokenizer and chat template, a folder's, or a Hub id's folder in the local Hugging Face cache
(``model/hub.py``). It is the one place that maps a model argument to a tokenizer outside the
engine.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=4)
def tokenizer_for(model: str | None, chat_template: str | None = None):
    """The model's tokenizer, with the chat template read from ``chat_template`` when given
    (cached per argument: callers share one object; it is only read)."""
    from ..model.hub import resolve_model
    from ..model.loader import shipped_model_path
    from ..model.tokenizer import load_tokenizer, with_chat_template

    path = Path(resolve_model(model) or shipped_model_path())
    if path.is_file():
        tokenizer = load_tokenizer(str(path.parent), path.name)
    else:
        tokenizer = load_tokenizer(str(path), None)
    return with_chat_template(tokenizer, chat_template)
