"""Request bodies of the OpenAI API, as strict pydantic models.

Strict on purpose: a field of the wrong type is an error, never coerced (``"5"`` is not 5);
an unknown field is an error, so a misspelt ``cache_salt`` cannot silently share a tenant's
cache. OpenAI fields this server cannot honour are accepted only at their neutral value
(``echo: false``, ``presence_penalty: 0``, ...), and rejected otherwise, saying so.

Bounded (issue 25): every list, map and object a body may hold has a length cap in the schema
itself, so validating any body under the size limit costs O(cap), and a body over a cap gets
one error (pydantic stops at the cap) instead of one per item. The caps:

=====================  =========  ==========================================================
what                   cap        why this value
=====================  =========  ==========================================================
``stop``               16         strings; OpenAI allows 4, vLLM sets no cap; 16 kept from
                                  before (clients sending up to 16 keep working)
each stop string       1,024      characters; a stop string longer than that can never
                                  match within a context this server serves usefully
``stop_token_ids``     1,024      vLLM sets no cap; no tokenizer has that many special
                                  tokens worth stopping on
``logit_bias``         1,024      entries (only the empty map is accepted: not supported)
prompt token ids       131,072    ids (the longest context of any model this serves)
``messages``           4,096      messages per chat
content parts          256        ``{"type": "text"}`` parts per message
``segments``           64         segments per prompt (``MAX_SEGMENTS``)
fields per object      64         keys in any JSON object of the body; known fields are
                                  far fewer, so beyond it the object is refused in one error
                                  naming its first unknown fields and their count
=====================  =========  ==========================================================

Lists whose items each cost an error (prompt token ids, messages, content parts) stop at their
first bad item (pydantic's ``fail_fast``): a 130,000-id prompt of ``-1`` is one error, not
130,000 (building those took pydantic 0.7 s holding the GIL, which a worker thread cannot
hide from the event loop). ``stop_token_ids`` and ``logit_bias`` report every bad item up to
their caps (at most 1,024 errors, milliseconds).

vLLM has no length caps on these fields (it bounds ``logprobs`` by ``max_logprobs`` = 20, as
here); the values above are ours, documented here and in the 400s that enforce them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_PROMPT_TOKEN_IDS = 1 << 17
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256
MAX_SALT_CHARS = 256
MAX_SEGMENTS = 64
MAX_FIELDS = 64
NAMED_UNKNOWN = 5  # unknown fields named in the message when an object has too many fields


def _short(name: object, limit: int = 64) -> str:
    text = repr(name)
    return text if len(text) <= limit else text[:limit - 4] + "...'"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _bounded_fields(cls, data):
        """An object with more keys than ``MAX_FIELDS`` is refused whole, in one error (the
        alternative, one ``extra_forbidden`` error per key, costs per key)."""
        if isinstance(data, dict) and len(data) > MAX_FIELDS:
            unknown = [k for k in data if k not in cls.model_fields]
            named = ", ".join(_short(k) for k in unknown[:NAMED_UNKNOWN])
            more = f" and {len(unknown) - NAMED_UNKNOWN:,} more" if len(unknown) > NAMED_UNKNOWN else ""
            raise ValueError(f"the object has {len(data):,} fields; at most {MAX_FIELDS} are accepted "
                             f"(unknown fields: {named}{more})")
        return data


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class SamplingFields(StrictModel):
    """What completions and chat share: sampling, stopping, streaming and the cache salt."""

    model: str | None = None  # None: the served model
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    n: Annotated[int, Field(ge=1, le=1, description="one choice per request")] = 1
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
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
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_count(cls, value):
        """Counted before the union: its own message would only say what the field must be."""
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, not {len(value):,}")
        return value

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


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS, fail_fast=True)]


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
    content: str | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS, fail_fast=True)]
    name: str | None = None

    def as_template_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]
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
