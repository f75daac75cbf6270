"""kvmosaic: an LLM inference engine whose KV cache is content-addressed and reused."""

from .engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
