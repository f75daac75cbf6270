"""``/v1/completions`` and ``/v1/chat/completions``: validate, queue, answer or stream.

Order of checks, each failing before the engine is touched: the API key (401), the body
(UTF-8, JSON, schema: 400; on a worker thread, with a chat's template, under a time budget:
413 beyond it, so no body stalls the event loop), the model name (404), the prompt against
the context and the sampling parameters (400, on the engine thread, where ``add_request``
validates before it queues). A request that passed them runs until it finishes or its client goes away; either
way it leaves no block in use.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from ..engine.output_processor import RequestOutput
from ..engine.sampling_params import SamplingParams
from . import echo as E
from . import responses as R
from .async_engine import AsyncEngine, RequestFailed, RequestStream
from .choices import merge
from .choices import usage as usage_of
from .errors import APIError, from_validation_error
from .params import sampling_params  # re-exported: callers import it from here
from .protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat, SamplingFields, ignored_fields
from .streaming import stream_chunks
from .tenancy import TenantPolicy
from .tenant_limits import TenantLimits
from .tools import ToolSession, forced_schema, template_renders_tools
from .tools import finish_reason as tool_finish

log = logging.getLogger("kvmosaic.server")

# A prompt longer than this many characters per token of context is refused before it is
# tokenised (no tokenizer makes tokens that long on average): rejected work must not cost.
MAX_CHARS_PER_TOKEN = 16
# Parsing, validating and (chat) templating one body, on a worker thread, may take this long;
# beyond it the request gets a 413 (issue 25). The schema's caps keep real bodies far below.
PARSE_BUDGET_S = 5.0
# chat_template_kwargs that would change how the template is called, not what it renders (the
# tokenizer's own apply_chat_template parameters are refused too, see OpenAIServing.template_kwargs).
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                      "return_dict", "return_tensors", "chat_template", "tools", "documents"})
T = TypeVar("T")


def client_left(request: Request, where: str) -> APIError:
    """A client that went away is one line in the log, not a traceback."""
    client = request.client
    log.info("client %s closed the connection %s (%s %s)", f"{client.host}:{client.port}" if client else "?",
             where, request.method, request.url.path)
    return APIError(499, "the client closed the connection")


def decode_and_validate(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The body's bytes to the request model, or the 400 that says why not (a worker thread runs it)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start}: {body[e.start:e.start + 1]!r})") from None
    if not text.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        req = model.model_validate_json(text)
    except ValidationError as e:
        raise from_validation_error(e) from None
    ignored = ignored_fields(req)
    if ignored:  # vLLM's rule: unknown fields are ignored, and named once
        shown = ", ".join(repr(f)[:80] for f in ignored[:8]) + (f" and {len(ignored) - 8} more" if len(ignored) > 8 else "")
        log.warning("The following fields were present in the request but ignored: %s", shown)
    return req


async def off_loop(fn: Callable[..., T], *args: object, budget: float | None = None) -> T:
    """``fn(*args)`` on a worker thread, so that no request's parsing, validation or template
    stalls the event loop (every other stream and probe); over ``budget`` seconds (default
    ``PARSE_BUDGET_S``) the request gets a 413 and the late result is dropped."""
    budget = PARSE_BUDGET_S if budget is None else budget
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), budget)
    except asyncio.TimeoutError:
        log.info("a request body took more than %.1f s to parse and validate; answering 413", budget)
        raise APIError(413, f"the request took more than {budget:g} s to parse and validate; this server refuses "
                            f"it (send fewer or shorter items)", code="request_too_complex") from None


async def read_body(request: Request) -> bytes:
    try:
        return await request.body()
    except ClientDisconnect:
        raise client_left(request, "while sending its body") from None


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    return await off_loop(decode_and_validate, await read_body(request), model)


class AbortOnClose(StreamingResponse):
    """A stream that aborts its engine request however it ends (finished: a no-op)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect) as e:  # the client went away mid-stream: one line
            client = scope.get("client") or ("?", "?")
            log.info("client %s:%s closed the connection during a stream (%s)", *client[:2], type(e).__name__)
        finally:
            self.on_close()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, tenants: TenantPolicy,
                 limits: TenantLimits | None = None, tool_parser: str | None = None,
                 auto_tools: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tenants = tenants
        self.limits = limits or TenantLimits()
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        info = engine.model_info
        self.pool_tokens = info.num_kv_blocks * info.block_size
        self.max_prompt_chars = self.max_model_len * MAX_CHARS_PER_TOKEN
        try:
            own = set(inspect.signature(self.tokenizer.apply_chat_template).parameters) - {"kwargs"}
        except (TypeError, ValueError):
            own = set()
        self.reserved_template_kwargs = RESERVED_TEMPLATE_KWARGS | own
        self.tool_parser, self.auto_tools = tool_parser, auto_tools
        self._template_tools: bool | None = None  # whether the chat template renders tools (probed once)

    def tool_session(self, req: ChatCompletionRequest) -> ToolSession | None:
        """How this chat's tools are handled (None: no tools in play), or the 400 that says why
        they cannot be: the template cannot show them, or ``auto`` without a parser."""
        choice = req.effective_tool_choice
        if choice in (None, "none"):
            return None
        if self._template_tools is None:
            self._template_tools = template_renders_tools(self.tokenizer)
        if not self._template_tools:
            raise APIError(400, "this model's chat template cannot render tools; start the server with "
                                "--chat-template chatml-tools (shipped: ChatML with Hermes tool calls) or "
                                "another template that renders them", "tools")
        if choice == "auto" and not (self.auto_tools and self.tool_parser):
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                'to be set', "tool_choice")
        return ToolSession(choice)

    def template_kwargs(self, kwargs: dict | None) -> dict:
        """``chat_template_kwargs`` as template variables: the keys that would change how the
        template is called (``tokenize``, ``continue_final_message``, ...) are dropped."""
        return {k: v for k, v in (kwargs or {}).items() if k not in self.reserved_template_kwargs}

    def _priority(self, req: SamplingFields) -> int:
        """The engine's priority (higher first) of vLLM's request field (lower first): accepted
        where a policy reads it (``--scheduling-policy priority``, engine/priority.py, or
        ``--eviction-policy priority``), a 400 otherwise, as vLLM refuses it without its policy."""
        config = self.engine.engine.config
        if req.priority and "priority" not in (config.scheduling_policy, config.eviction_policy):
            raise APIError(400, f"priority {req.priority} asks for priority scheduling, which this server does not run "
                                "(start it with --scheduling-policy priority)", "priority")
        return -req.priority

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse a prompt no tokenizer could fit in the context, before tokenising it."""
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"the prompt has {num_chars} characters; this server refuses more than "
                                f"{self.max_prompt_chars} ({MAX_CHARS_PER_TOKEN} per token of its "
                                f"{self.max_model_len}-token context) without tokenising them", param)

    def decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_text(self, req: SamplingFields) -> R.Decode:
        """How log-probabilities name a token: its text, or with vLLM's ``return_tokens_as_token_ids``
        ``"token_id:<id>"`` (a token whose bytes are not text stays identifiable)."""
        return R.token_id_text if req.return_tokens_as_token_ids else self.decode

    async def completions(self, request: Request):
        token = self.tenants.authenticate(request.headers.get("authorization"))
        req: CompletionRequest = await parse_body(request, CompletionRequest)
        segments = sum(len(x) for x in req.segments or []) + len(req.segment_suffix)
        for p in req.prompts:
            self.check_chars((len(p) if isinstance(p, str) else 0) + segments, "prompt")
        return await self._serve(request, req, token, req.engine_prompts, req.max_tokens, req.logprobs, "prompt",
                                 chat=False)

    async def chat(self, request: Request):
        token = self.tenants.authenticate(request.headers.get("authorization"))
        req, prompt, tools = await off_loop(self.parse_chat, await read_body(request))
        top = (req.top_logprobs or 0) if req.logprobs else None
        return await self._serve(request, req, token, [prompt], req.max_new_tokens, top, "messages", chat=True,
                                 tools=tools)

    def parse_chat(self, body: bytes) -> tuple[ChatCompletionRequest, str, ToolSession | None]:
        """The request, its prompt text and its tool handling: validation and the template, on a
        worker thread under one time budget (a template costs per message). A forced tool
        choice becomes the request's JSON-schema grammar (server/tools.py)."""
        req = decode_and_validate(body, ChatCompletionRequest)
        messages = [m.as_template_dict() for m in req.messages]
        self.check_chars(sum(len(m["content"] or "") for m in messages), "messages")
        extra = self.template_kwargs(req.chat_template_kwargs)
        tools = self.tool_session(req)
        if tools is not None:
            extra["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
            schema = forced_schema(req.tools, tools.choice)
            if schema is not None:
                req.response_format = ResponseFormat(type="json_schema", json_schema={"name": "tools", "schema": schema})
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=req.add_generation_prompt, **extra)
        except Exception as e:  # the template's own checks (e.g. role order) raise here
            raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from None
        return req, prompt, tools

    async def _serve(self, request: Request, req: SamplingFields, token: str | None,
                     prompts: list[str | list[int] | dict], max_tokens: int | None, logprobs: int | None,
                     prompt_param: str, chat: bool, tools: ToolSession | None = None):
        """Queue every prompt's ``n`` samples (choice ``prompt * n + sample``), then answer or
        stream them; a prompt refused refuses the request, and the prompts queued before it
        are aborted (nothing stays in use)."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found")
        salt, tenant = self.tenants.cache_salt(token, req.cache_salt), self.tenants.tenant_label(token)
        admitted: list[int] = []  # the prompt tokens counted against the tenant's limits
        streams: list[RequestStream] = []

        def make_params(num_prompt: int) -> SamplingParams:
            params = sampling_params(req, max_tokens, num_prompt, self.max_model_len, logprobs, prompt_param,
                                     self.pool_tokens)
            self.limits.admit(tenant, num_prompt)  # 429 over the tenant's limits
            admitted.append(num_prompt)
            return params

        def release() -> None:
            while admitted:
                self.limits.release(tenant, admitted.pop())

        def abort_all() -> None:
            for s in streams:
                self.engine.abort(s.request_id)
            release()

        priority = self._priority(req)
        try:
            for prompt in prompts:
                prompt, psalt = await self.tenants.resolve(self.engine.engine, req, prompt, salt)  # shared-public head
                streams += await self.engine.add_samples(prompt, make_params, psalt, tenant, req.truncate_prompt_tokens,
                                                         priority)
        except ValueError as e:
            abort_all()
            raise APIError(400, str(e), prompt_param) from None
        except BaseException:
            abort_all()
            raise
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return AbortOnClose(stream_chunks(streams, req, rid, created, self.model_name, logprobs, chat,
                                              functools.cache(self.token_text(req)), self.tokenizer.decode, tools),
                                abort_all)
        try:
            outs = await self._collect(request, streams)
        finally:
            abort_all()  # every request finished: only the tenant's count is released
        # Built and serialised on a worker thread: a body of log-probabilities over thousands of
        # tokens takes a second of Python, which on the event loop would hold every other stream.
        body = await asyncio.to_thread(self._whole_body, outs, req, rid, created, logprobs, chat, tools)
        return Response(body, media_type="application/json")

    def _whole_body(self, outs: list[RequestOutput], req: SamplingFields, rid: str, created: int,
                    logprobs: int | None, chat: bool, tools: ToolSession | None) -> bytes:
        """A non-streamed response's JSON."""
        if req.echo_without_generation:
            outs = [E.without_generation(o) for o in outs]
        decode = functools.cache(self.token_text(req))  # a token's text once per response
        choices = []
        for i, out in enumerate(outs):
            if chat:
                lps = R.chat_logprobs(out, 0, decode, logprobs or 0) if logprobs is not None else None
                choice = R.chat_choice(i, out, lps)
                if tools is not None:
                    content, calls = tools.message(out.text)
                    choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    choice["finish_reason"] = tool_finish(out.finish_reason, calls)
                if req.return_token_ids:
                    choice["token_ids"] = out.token_ids
                choices.append(choice)
            else:
                choices.append(E.completion_choice(i, out, req.echo, logprobs, decode, self.tokenizer.decode,
                                                   bool(req.return_token_ids)))
        body = (R.chat_body if chat else R.completion_body)(rid, created, self.model_name, choices,
                                                           usage_of(outs, req.return_miss_reasons))
        if chat and outs[0].prompt_logprobs is not None:  # vLLM's place for it in a chat response
            body["prompt_logprobs"] = E.prompt_logprobs(outs[0], decode)
        if chat and req.return_token_ids:
            body["prompt_token_ids"] = outs[0].prompt_token_ids
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    async def _collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of every stream, in order; aborts them all if the client goes away
        first or one fails (the caller aborts; a finished request's abort does nothing)."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        left = len(streams)
        results = merge(streams)
        try:
            async for i, out in results:
                if out.finished:
                    finals[i], left = out, left - 1
                    if not left:
                        return finals  # type: ignore[return-value]
                elif await request.is_disconnected():
                    break
        except RequestFailed as e:  # this request failed, or the server cut it (drain)
            if e.status != 499:
                raise APIError(e.status, e.message, code=e.reason,
                               headers={"Retry-After": "5"} if e.status == 503 else None) from None
        finally:
            await results.aclose()
        raise client_left(request, "while its request ran")
