"""kvmosaic: an LLM inference engine whose KV cache is content-addressed and reused.

The top-level names load lazily (PEP 562), so ``import kvmosaic.cache`` — the torch-free
bookkeeping a router, a tier server or a simulator needs — does not pull in torch or
transformers. See docs/ARCHITECTURE.md for the layers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .huge_pages import request_huge_pages

request_huge_pages()  # before anything of the package allocates: torch latches it then (huge_pages.py)

if TYPE_CHECKING:
    from .engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams, StructuredOutputs

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutputs"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".engine", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
