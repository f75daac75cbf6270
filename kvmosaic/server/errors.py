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

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               431: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


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
    "prompt": "must be a non-empty string or a non-empty list of token ids (one prompt per request)",
    "stop": "must be a string or a list of non-empty strings",
    "content": "must be a string or a non-empty list of {\"type\": \"text\", \"text\": ...} parts",
}
BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _is_branch_tag(part: str) -> bool:
    return part in BRANCH_TAGS or part.split("[", 1)[0] in BRANCH_TAGS or part.startswith(("constrained-", "function-"))


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """One message naming every offending field, e.g. ``temperature: Input should be less
    than or equal to 2``; ``param`` is the first field."""
    parts: list[str] = []
    params: list[str] = []
    hinted: list[str] = []
    for err in exc.errors():
        raw = [str(x) for x in err.get("loc", ()) if x != "body"]
        loc = [x for x in raw if not _is_branch_tag(x)]
        field = ".".join(loc)
        if any(field == h or field.startswith(h + ".") for h in hinted):
            continue  # another branch of a union already explained
        if err["type"] == "json_invalid":
            msg = f"the request body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}"
        elif not loc:
            msg = err["msg"].removeprefix("Value error, ") if err["type"] == "value_error" else \
                "the request body must be a JSON object"
        elif err["type"] == "extra_forbidden":
            msg = f"unknown field {field!r}"
        elif len(loc) < len(raw) and loc[-1] in UNION_HINTS:
            msg = f"{field}: {UNION_HINTS[loc[-1]]}"
            hinted.append(field)
        else:
            msg = f"{field}: {err['msg']}"
        if msg not in parts:
            parts.append(msg)
        if field and field not in params:
            params.append(field)
    return APIError(400, "; ".join(parts), params[0] if params else None)


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
