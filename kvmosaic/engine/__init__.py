"""Requests, scheduling, the model runner, sampling and the ``LLM`` API."""

from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
