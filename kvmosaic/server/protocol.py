"""Request bodies of the OpenAI API, as strict pydantic models.

Strict on purpose: a field of the wrong type is an error, never coerced (``"5"`` is not 5);
an unknown field is an error, so a misspelt ``cache_salt`` cannot silently share a tenant's
cache. OpenAI fields this server cannot honour are accepted only at their neutral value
(``echo: false``, ``presence_penalty: 0``, ...), and rejected otherwise, saying so.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 16
MAX_SALT_CHARS = 256
MAX_SEGMENTS = 64


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingFields(StrictModel):
    """What completions and chat share: sampling, stopping, streaming and the cache salt."""

    model: str | None = None  # None: the served model
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    n: Annotated[int, Field(ge=1, le=1, description="one choice per request")] = 1
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_SALT_CHARS)] | None = None
    # shared-public tenancy: the first N chat messages (or prompt characters / token ids) are public
    public_prefix: Annotated[int, Field(ge=0)] | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise ValueError(f"{name} is not supported (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if isinstance(self.stop, str) and not self.stop or isinstance(self.stop, list) and not all(self.stop):
            raise ValueError("stop strings must not be empty")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    # kvmosaic extension: the prompt is ``prompt + segments... + segment_suffix``; with the
    # server's --segment-reuse on, each segment's KV is reused wherever it stood before.
    segments: Annotated[list[str], Field(min_length=1, max_length=MAX_SEGMENTS)] | None = None
    segment_suffix: str = ""

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.segments is not None and not isinstance(self.single_prompt, str):
            raise ValueError("with segments, prompt must be a string (the text before them)")
        if self.segments is None and self.segment_suffix:
            raise ValueError("segment_suffix needs segments")
        return self

    @property
    def engine_prompt(self) -> str | list[int] | dict:
        """What the engine takes: the prompt, or the segmented prompt dict."""
        if self.segments is None:
            return self.single_prompt
        return {"prompt": self.single_prompt, "segments": list(self.segments), "suffix": self.segment_suffix}

    @property
    def single_prompt(self) -> str | list[int]:
        """Batched prompts are limited to one (by the schema): unwrap it."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]
        return p


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None

    def as_template_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """None: whatever the context leaves (vLLM's default for chat)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
