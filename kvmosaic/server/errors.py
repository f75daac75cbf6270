"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every 4xx says what is wrong in ``message`` and, where one field is to blame, names it in
``param``. Handlers here turn pydantic's validation errors and Starlette's HTTP errors into
that shape, so no response of this server carries FastAPI's default ``{"detail": ...}``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import MAX_PROMPTS, MAX_STOP_CHARS, MAX_STOP_STRINGS

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               429: "rate_limit_error", 431: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# What a field must be, for fields whose type is a union (pydantic reports each branch).
UNION_HINTS = {
    "prompt": "must be a non-empty string, a non-empty list of token ids, or a list of either (at most "
              f"{MAX_PROMPTS} prompts)",
    "stop": f"must be a string or a list of non-empty strings (at most {MAX_STOP_STRINGS}, each at most "
            f"{MAX_STOP_CHARS} characters)",
    "content": "must be a string or a non-empty list of {\"type\": \"text\", \"text\": ...} parts",
}
BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict"}
MAX_LISTED = 5  # problems named in one message; the rest are counted
MAX_PART_CHARS = 300  # one listed problem (a field name may be as long as the body)
MAX_PARAM_CHARS = 128


def _is_branch_tag(part: str) -> bool:
    return part in BRANCH_TAGS or part.split("[", 1)[0] in BRANCH_TAGS or part.startswith(("constrained-", "function-"))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """One message naming the first ``MAX_LISTED`` offending fields, e.g. ``temperature: Input
    should be less than or equal to 2``, and counting the rest (``...; and 39,995 more``);
    ``param`` is the first field. Linear in the number of errors (sets, not list scans), and
    the message is short whatever the body: a body that fails in 100,000 places costs its
    server no more than a few passes over the errors, and its client a few hundred bytes."""
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
    else:
        errors = exc.errors()
    listed: list[str] = []
    seen: set[str] = set()
    hinted: set[str] = set()
    param: str | None = None
    for err in errors:
        raw = [str(x) for x in err.get("loc", ()) if x != "body"]
        loc = [x for x in raw if not _is_branch_tag(x)]
        field = ".".join(loc)
        if hinted and any(".".join(loc[:i]) in hinted for i in range(1, len(loc) + 1)):
            continue  # another branch of a union already explained
        text = err["msg"].removeprefix("Value error, ") if err["type"] == "value_error" else err["msg"]
        if err["type"] == "json_invalid":
            msg = f"the request body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}"
        elif not loc:
            msg = text if err["type"] == "value_error" else "the request body must be a JSON object"
        elif err["type"] == "extra_forbidden":
            msg = f"unknown field {_clip(field, MAX_PARAM_CHARS)!r}"
        elif len(loc) < len(raw) and loc[-1] in UNION_HINTS:
            msg = f"{field}: {UNION_HINTS[loc[-1]]}"
            hinted.add(field)
        else:
            msg = f"{field}: {text}"
        if msg in seen:
            continue
        seen.add(msg)
        if len(listed) < MAX_LISTED:
            listed.append(_clip(msg, MAX_PART_CHARS))
        if field and param is None:
            param = _clip(field, MAX_PARAM_CHARS)
    more = len(seen) - len(listed)
    message = "; ".join(listed) + (f"; ... and {more:,} more" if more else "")
    return APIError(400, message, param)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))
