"""Body size limit, enforced before and while reading: a declared Content-Length over the limit is
refused unread (413); a chunked body is counted as it arrives and cut off at the limit."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracetrain.gateway.errors import error_response


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    return await error_response(400, "Content-Length is not a number")(
                        scope, receive, send
                    )
                if int(value) > self.limit:
                    return await BodyTooLargeResponse(self.limit)(scope, receive, send)
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
