"""Every error is JSON in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Client mistakes are 4xx with a message naming what is wrong; only a failing engine gives
502/503/504 (EngineError.status); anything else unexpected is a bug (500, logged).
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tracetrain.engines.base import EngineError, PromptTooLong
from tracetrain.store import (
    IllegalTransition,
    RolloutConflict,
    RolloutEnded,
    StoreError,
    UnknownRollout,
    UnknownTurn,
)

log = logging.getLogger("tracetrain.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
}


class ApiError(HTTPException):
    """A client error with a message and, where one field is at fault, its name (`param`)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message)
        self.param = param


def error_response(
    status: int, message: str, param: str | None = None, headers=None
) -> JSONResponse:
    kind = _TYPES.get(status, "engine_error" if status in (502, 503, 504) else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _loc(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


async def _http(request: Request, exc: HTTPException) -> JSONResponse:
    param = getattr(exc, "param", None)
    return error_response(exc.status_code, str(exc.detail), param, getattr(exc, "headers", None))


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    bad_json = [e for e in errors if e.get("type") == "json_invalid"]
    if bad_json:
        ctx = bad_json[0].get("ctx") or {}
        return error_response(400, f"malformed JSON body: {ctx.get('error', 'cannot parse')}")
    parts = []
    for e in errors[:5]:
        msg = e.get("msg", "invalid")
        parts.append(f"{_loc(tuple(e.get('loc', ())))}: {msg}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    first = _loc(tuple(errors[0].get("loc", ()))) if errors else None
    return error_response(422, "; ".join(parts) + more, param=first)


async def _store(request: Request, exc: StoreError) -> JSONResponse:
    if isinstance(exc, UnknownRollout):
        return error_response(404, str(exc))
    if isinstance(exc, UnknownTurn):
        return error_response(422, str(exc), param="turn")
    if isinstance(exc, IllegalTransition | RolloutEnded | RolloutConflict):
        return error_response(409, str(exc))
    log.error("store failure: %s", exc)
    return error_response(503, f"store unavailable: {exc}")


async def _engine(request: Request, exc: EngineError) -> JSONResponse:
    return error_response(exc.status, f"engine error: {exc}")


async def _too_long(request: Request, exc: PromptTooLong) -> JSONResponse:
    return error_response(400, str(exc), param="messages")


async def _bug(request: Request | None, exc: Exception) -> JSONResponse:
    where = "a stream" if request is None else f"{request.method} {request.url.path}"
    log.exception("unhandled error on %s", where)
    return error_response(500, f"internal error: {type(exc).__name__}")


HANDLERS = {
    HTTPException: _http,
    RequestValidationError: _validation,
    StoreError: _store,
    EngineError: _engine,
    PromptTooLong: _too_long,
    Exception: _bug,
}


async def handle(request: Request | None, exc: Exception) -> JSONResponse:
    """The error answer for `exc`, chosen as Starlette does: the handler of the nearest class in
    its MRO (for routes served outside Starlette's middleware, see fast_routes.py; request None: raised
    in a stream, after its 200 went out)."""
    for cls in type(exc).__mro__:
        if cls in HANDLERS:
            return await HANDLERS[cls](request, exc)
    raise exc  # a BaseException that is not an Exception (cancellation): not ours to answer


async def body(exc: Exception) -> dict:
    """The error answer's JSON for `exc` raised in a stream, after its 200 went out (sent as an
    event instead)."""
    return orjson.loads((await handle(None, exc)).body)


def install(app: FastAPI) -> None:
    for cls, handler in HANDLERS.items():
        app.add_exception_handler(cls, handler)
