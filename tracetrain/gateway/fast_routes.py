"""The model routes answered straight from ASGI, before FastAPI's middleware stack and router.

    POST /rollouts/{rollout_id}[/roles/{role}]/v1/chat/completions | /v1/completions
         | /v1/responses | /v1/messages
      -> size limit (limits.declared_error, limits.read_body) -> openai_routes.chat_turn,
         completion_turn, responses_routes.responses_turn or anthropic_routes.messages_turn ->
         the answer; an exception -> errors.handle, as the FastAPI routes do (in Anthropic's
         error shape on /v1/messages)

Every agent call takes this path, so it skips the middleware stack and the matching over every
route (docs/bench-gateway.md has what they cost). The behaviour is that of the FastAPI routes, which
stay registered (documented, and used if the app is mounted under a prefix): same auth, limits,
validation and error bodies.
"""

from __future__ import annotations

import logging
import re

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from tracetrain.gateway import anthropic_routes, errors, limits, openai_routes, responses_routes

# What is served here, before the middleware stack: path -> (rollout id, role or None, route)
MODEL_ROUTE = re.compile(
    r"/rollouts/([^/]+)(?:/roles/([^/]+))?/v1/(chat/completions|completions|responses|messages)"
)
TURNS = {
    **openai_routes.TURNS,
    "responses": responses_routes.responses_turn,
    "messages": anthropic_routes.messages_turn,
}

log = logging.getLogger("tracetrain.gateway")


async def serve(gw, match: re.Match, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer one model call; `match` is MODEL_ROUTE's match of the path."""
    anthropic = match[3] == "messages"
    try:
        headers = scope["headers"]
        refused = limits.declared_error(headers, gw.max_body_bytes)
        if refused is not None:
            return await refused(scope, receive, send)
        authorization = x_api_key = None
        for name, value in headers:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-api-key":
                x_api_key = value.decode("latin-1")
        if anthropic:  # the anthropic SDK sends its key as x-api-key
            authorization = anthropic_routes.authorization_of(authorization, x_api_key)
        raw = await limits.read_body(receive, gw.max_body_bytes)
        response = await TURNS[match[3]](gw, match[1], authorization, raw, match[2])
    except ClientDisconnect:
        return
    except Exception as exc:
        response = await errors.handle(Request(scope, receive), exc)
    if anthropic and response.status_code >= 400:
        response = anthropic_routes.anthropic_error(response)
    await response(scope, receive, send)


__all__ = ["MODEL_ROUTE", "serve"]
