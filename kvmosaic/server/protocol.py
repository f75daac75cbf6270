"""Request bodies of the OpenAI API (and vLLM's extensions), as strict pydantic models.

Strict on purpose: a field of the wrong type is an error, never coerced (``"5"`` is not 5).
An unknown field is ignored and named in one log line per request (vLLM's rule, so the
extras that SDKs send do not break clients; :func:`ignored_fields` finds them, nested ones
included). Known fields this server cannot honour (``suffix``, ``best_of`` other than ``n``,
``use_beam_search``) are accepted only at their neutral value, and a 400 naming the field
otherwise; a ``priority`` other than 0 only under ``--scheduling-policy priority``, as vLLM. (A
misspelt ``cache_salt`` is therefore ignored, with that log line; to keep tenants apart without
trusting the body, derive salts from API keys, server/tenancy.py.) Known fields that change
nothing here (``store``, ``metadata``, ``service_tier``, ``parallel_tool_calls``, ``user``) are
accepted.

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
``logit_bias``         1,024      entries (token id -> bias in [-100, 100])
prompt token ids       131,072    ids (the longest context of any model this serves)
prompts per request    64         ``/v1/completions``'s list of prompts; with ``n``, at most
                                  256 choices (``MAX_CHOICES``) per request
``n``                  64         samples per prompt (``SamplingParams``' ``MAX_N``)
``metadata``           16         pairs (OpenAI's limit), keys 64 and values 512 characters
``chat_template_kwargs`` 64       keys (``MAX_FIELDS``)
``vllm_xargs``         64         keys of at most 64 characters; a list value at most 64 items
``messages``           4,096      messages per chat
content parts          256        ``{"type": "text"}`` parts per message
``segments``           64         segments per prompt (``MAX_SEGMENTS``)
``structured_outputs`` 65,536     characters of a ``regex`` or ``grammar``; ``choice``: 1,024
                                  strings of at most 1,024 characters (a grammar compiles in
                                  time that grows with its size, on a worker thread)
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

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from ..engine.sampling_params import MAX_N
from .output_formats import ResponseFormat, StructuredOutputsRequest
from .strict import MAX_FIELDS, MAX_STOP_CHARS, StrictModel, short_repr
from .tools import MAX_TOOLS, NamedToolChoice, ToolChoice, ToolList

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_PROMPT_TOKEN_IDS = 1 << 17
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256
MAX_SALT_CHARS = 256
MAX_SEGMENTS = 64
MAX_PROMPTS = 64
MAX_CHOICES = 256
MAX_METADATA = 16


def ignored_fields(model: BaseModel, where: str = "") -> list[str]:
    """The unknown (ignored) fields of ``model`` and of the objects inside it, as dotted paths
    (``messages.0.a``); linear in the body's objects."""
    out = [f"{where}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                out += ignored_fields(item, f"{where}{name}." + ("" if i is None else f"{i}."))
    return out


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
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
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
    # issue 23: usage.prompt_tokens_details.miss_reasons (missed prompt tokens by reason, the
    # caller's own namespace only)
    return_miss_reasons: bool = False
    # vLLM's: the generated token ids beside the text, and the prompt's (responses.with_token_ids)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>"
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                                 Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS, fail_fast=True)] | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    skip_special_tokens: bool = True
    # Accepted, changing nothing here (OpenAI SDK fields).
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = None
    service_tier: str | None = None
    # vLLM's: for every prompt token but the first, its log-probability and the top-k before it
    # (server/echo.py); the request then computes its whole prompt, reading nothing from the cache.
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's: lower is scheduled first, under --scheduling-policy priority (engine/priority.py);
    # any other value than 0 is a 400 otherwise (vLLM's rule)
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0
    # Known, supported only at its neutral value (a 400 naming the field otherwise).
    use_beam_search: bool = False
    # vLLM's: keep the prompt's last k tokens (-1: the context's length) (engine/input_processor.py)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's (server/params.py)
    # vLLM's custom arguments, carried to SamplingParams.extra_args; read here: auto_reuse_max_drift
    # (a number >= 0: this request's bound on automatic reuse's drift estimate, engine/sampling_params.py)
    vllm_xargs: Annotated[dict[Annotated[str, Field(max_length=64)],
                               str | int | float | Annotated[list[str | int | float], Field(max_length=MAX_FIELDS)]],
                          Field(max_length=MAX_FIELDS)] | None = None

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
        if self.use_beam_search:
            raise ValueError("use_beam_search is not supported by this server (only false)")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), not {short_repr(key)}")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the context's length) or at least 1")
        if isinstance(self.stop, str) and not self.stop or isinstance(self.stop, list) and not all(self.stop):
            raise ValueError("stop strings must not be empty")
        return self

    @property
    def echoes(self) -> bool:
        """Whether the answer begins with the prompt (the completions API's ``echo``)."""
        return False

    @property
    def echo_without_generation(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt alone, scored."""
        return False

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS, fail_fast=True)]


class CompletionRequest(SamplingFields):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    echo: bool = False  # before max_tokens: its check reads it
    # 0 only with echo: the prompt alone, scored (server/echo.py)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    # kvmosaic extension: the prompt is ``prompt + segments... + segment_suffix``; with the
    # server's --segment-reuse on, each segment's KV is reused wherever it stood before.
    segments: Annotated[list[str], Field(min_length=1, max_length=MAX_SEGMENTS)] | None = None
    segment_suffix: str = ""

    @property
    def echoes(self) -> bool:
        return self.echo

    @property
    def echo_without_generation(self) -> bool:
        return self.echo and self.max_tokens == 0

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, value, info):
        if value == 0 and not info.data.get("echo"):
            raise ValueError("Input should be greater than or equal to 1 (0 asks for the prompt alone: only with echo)")
        return value

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported by this server other than equal to n ({self.n}): every "
                             f"sample is returned; ask for n={self.best_of} and rank them yourself")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts)} prompts x n={self.n} asks for {len(self.prompts) * self.n} "
                             f"choices; at most {MAX_CHOICES} per request")
        if self.segments is not None and not (isinstance(self.prompt, str) or len(self.prompts) == 1
                                              and isinstance(self.prompts[0], str)):
            raise ValueError("with segments, prompt must be a string (one: the text before them)")
        if self.segments is None and self.segment_suffix:
            raise ValueError("segment_suffix needs segments")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or several (OpenAI: a string, token ids, or a list of either)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    @property
    def single_prompt(self) -> str | list[int]:
        """The first prompt (a router hashes it to pick a replica)."""
        return self.prompts[0]

    @property
    def engine_prompts(self) -> list[str | list[int] | dict]:
        """What the engine takes, per prompt: the prompt, or the segmented prompt dict."""
        if self.segments is None:
            return self.prompts
        return [{"prompt": self.prompts[0], "segments": list(self.segments), "suffix": self.segment_suffix}]


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class CalledFunction(StrictModel):
    name: str
    arguments: str


class AssistantToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only for an assistant message that made tool calls
    content: str | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS, fail_fast=True)] | None
    name: str | None = None
    tool_calls: Annotated[list[AssistantToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self

    def as_template_dict(self) -> dict:
        """What the chat template sees; a call's JSON arguments become an object (vLLM does
        the same: templates write ``arguments | tojson``)."""
        content = self.content
        text = content if isinstance(content, str) or content is None else "".join(p.text for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Template variables (e.g. ``enable_thinking``) for the model's chat template.
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_FIELDS)] | None = None
    add_generation_prompt: bool = True
    # Tools (server/tools.py): through the chat template, parsed by --tool-call-parser, or forced.
    tools: ToolList | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        choice = self.effective_tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not in tools")
        if choice not in (None, "none", "auto") and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("response_format cannot be combined with tool_choice 'required' or a named function")
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice | None:
        """OpenAI's default: ``auto`` when tools are given, else none (None: no tools)."""
        if not self.tools:
            return None if self.tool_choice in (None, "none", "auto") else self.tool_choice
        return self.tool_choice or "auto"

    @property
    def max_new_tokens(self) -> int | None:
        """None: whatever the context leaves (vLLM's default for chat)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
