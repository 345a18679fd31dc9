"""Body size limit, enforced before and while reading: a declared Content-Length over the limit is
refused unread (413); a chunked body is counted as it arrives and cut off at the limit.

`BodySizeLimit` is the middleware for the FastAPI routes; `declared_error` and `read_body` do the
same for the model routes, which are served before the middleware stack (fast_routes.py).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracetrain.gateway.errors import error_response


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


def declared_error(headers, limit: int) -> Response | None:
    """The error answer for a Content-Length header that is not a number or is over `limit`."""
    for name, value in headers:
        if name == b"content-length":
            if not value.isdigit():
                return error_response(400, "Content-Length is not a number")
            if int(value) > limit:
                return BodyTooLargeResponse(limit)
    return None


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; BodyTooLarge once more than `limit` bytes arrived."""
    chunks: list[bytes] = []
    received = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = declared_error(scope["headers"], self.limit)
        if refused is not None:
            return await refused(scope, receive, send)
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)


def BodyTooLargeResponse(limit: int):  # noqa: N802 - reads like the response class it returns
    return error_response(413, f"request body is larger than the limit of {limit} bytes")
