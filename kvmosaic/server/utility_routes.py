"""vLLM's utility endpoints, in vLLM's shapes: ``/tokenize``, ``/detokenize``, ``/version``,
``/ping`` (GET and POST) and ``/v1/models/{id}``.

``/tokenize`` and ``/detokenize`` need the API key when keys are configured (they run the
tokenizer: work a stranger should not get for free); their bodies are validated and the
tokenizer runs off the event loop under the parse budget (``serving.off_loop``), as for the
completion routes. ``/ping`` is readiness without a body (200, or 503 while draining, as
``/health``); ``/version`` and ``/ping`` need no key.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from .. import __version__
from .drain import RETRY_AFTER_S, Drain
from .errors import APIError
from .protocol import MAX_FIELDS, MAX_MESSAGES, MAX_PROMPT_TOKEN_IDS, ChatMessage, StrictModel
from .serving import OpenAIServing, decode_and_validate, off_loop, read_body


class TokenizeRequest(StrictModel):
    """vLLM's two forms: ``prompt`` (a completion) or ``messages`` (a chat, templated)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)] | None = None
    add_special_tokens: bool | None = None  # vLLM: True for a prompt, False for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_FIELDS)] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_PROMPT_TOKEN_IDS, fail_fast=True)]


def add_utility_routes(app: FastAPI, serving: OpenAIServing, drain: Drain, created: int) -> None:
    tenants, tokenizer = serving.tenants, serving.tokenizer
    vocab = serving.engine.engine.model_config.vocab_size

    def check_model(model: str | None) -> None:
        if model is not None and model != serving.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {serving.model_name!r}",
                           "model", "model_not_found")

    def tokenize(body: bytes) -> dict:
        req: TokenizeRequest = decode_and_validate(body, TokenizeRequest)  # type: ignore[assignment]
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either prompt or messages")
        if req.messages is not None:
            extra = serving.template_kwargs(req.chat_template_kwargs)
            messages = [m.as_template_dict() for m in req.messages]
            serving.check_chars(sum(len(m["content"]) for m in messages), "messages")
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=req.add_generation_prompt, **extra)
            except Exception as e:  # the template's own checks
                raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from None
            special = bool(req.add_special_tokens)
        else:
            serving.check_chars(len(req.prompt or ""), "prompt")
            text, special = req.prompt or "", req.add_special_tokens is not False
        ids = list(tokenizer.encode(text, add_special_tokens=special))
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(body: bytes) -> dict:
        req: DetokenizeRequest = decode_and_validate(body, DetokenizeRequest)  # type: ignore[assignment]
        check_model(req.model)
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of the vocabulary (ids must be in [0, {vocab}))", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        tenants.authenticate(request.headers.get("authorization"))
        return JSONResponse(await off_loop(tokenize, await read_body(request)))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        tenants.authenticate(request.headers.get("authorization"))
        return JSONResponse(await off_loop(detokenize, await read_body(request)))

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        if drain.draining:
            return Response(status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return Response(status_code=200)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        tenants.authenticate(request.headers.get("authorization"))
        if model_id != serving.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return model_card(serving.model_name, created, serving.max_model_len)


def model_card(name: str, created: int, max_model_len: int) -> dict:
    """One entry of ``/v1/models`` (OpenAI's model object, with vLLM's ``max_model_len``)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "kvmosaic",
            "max_model_len": max_model_len}
