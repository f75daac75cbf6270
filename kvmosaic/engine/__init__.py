"""Requests, scheduling, the model runner, sampling and the ``LLM`` API.

The names below load lazily (PEP 562), so that ``kvmosaic.engine.arg_utils`` — the options a
command parses before anything runs (``kvmosaic serve --replicas`` starts Ray meanwhile) — does
not pull in torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import EngineConfig
    from .llm import LLM
    from .llm_engine import LLMEngine, RequestOutput
    from .sampling_params import SamplingParams, StructuredOutputs

__all__ = ["EngineConfig", "LLM", "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutputs"]
_MODULES = {"EngineConfig": ".config", "LLM": ".llm", "LLMEngine": ".llm_engine", "RequestOutput": ".llm_engine",
            "SamplingParams": ".sampling_params", "StructuredOutputs": ".sampling_params"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
