"""A bare gateway: the least any gateway on the same stack does per chat call, as a floor to
measure the real one against (bench_context.py --bare).

    python bench/bare_gateway.py UPSTREAM_URL     # prints TRACETRAIN_GATEWAY_URL=http://...

Served like the real gateway (tracetrain.gateway.serve: uvicorn with uvloop + httptools, the same
uvicorn settings and GC settings). Per chat call it reads the body, parses the JSON (orjson),
sends one vLLM completions request upstream (engines.upstream.request_body, aiohttp, one pooled
session), parses the answer (engines.upstream.parse_choice) and answers an OpenAI chat completion
with one tool call, so that a harness's conversation grows by the same messages as through the
gateway. Nothing else: no auth, no validation, no chat template or tokenizer (the prompt is
one id per 4 bytes of the body), no tool-call parsing, no store.
`POST /rollouts` and `PATCH /rollouts` answer what bench_context's agents need.
"""

from __future__ import annotations

import gc
import itertools
import sys
import uuid

import aiohttp
import orjson

from tracetrain.engines.base import SamplingParams
from tracetrain.engines.upstream import parse_choice, request_body
from tracetrain.gateway.inprocess import listen_socket
from tracetrain.gateway.serve import ReadyServer, uvicorn_config

JSON = [(b"content-type", b"application/json")]


class Bare:
    """The ASGI app: upstream is a vLLM-compatible base URL (…/v1 is added)."""

    def __init__(self, upstream: str):
        self.url = upstream.rstrip("/") + "/v1/completions"
        self.session: aiohttp.ClientSession | None = None
        self.calls = itertools.count()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await self.session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        if scope["path"] == "/rollouts":
            return await self.rollouts(scope, raw, send)
        body = orjson.loads(raw)
        prompt = list(range(100, 100 + len(raw) // 4))
        params = SamplingParams(max_tokens=body.get("max_tokens") or 64)
        upstream = orjson.dumps(request_body("fake", prompt, params))
        async with self.session.post(self.url, data=upstream,
                                     headers={"Content-Type": "application/json"}) as r:
            ids, _, _ = parse_choice(orjson.loads(await r.read()))
        call = next(self.calls)
        message = {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{call}", "type": "function",
            "function": {"name": "calc", "arguments": orjson.dumps({"expr": f"{call}*17"}).decode()},
        }]}
        await self.answer(send, {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "model": "fake",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)},
        })

    async def rollouts(self, scope, raw: bytes, send) -> None:
        if scope["method"] != "POST":  # PATCH: the agents end their rollouts
            return await self.answer(send, {})
        host, port = scope["server"]
        base = f"http://{host}:{port}/rollouts"
        made = [{"rollout_id": f"r{k}", "api_key": "bare", "base_url": f"{base}/r{k}/v1"}
                for k in range(len(orjson.loads(raw)["rollouts"]))]
        await self.answer(send, {"rollouts": made})

    @staticmethod
    async def answer(send, content: dict) -> None:
        data = orjson.dumps(content)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*JSON, (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


def main() -> None:
    sock = listen_socket("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)  # as tracetrain.gateway.serve
    server = ReadyServer(uvicorn_config(Bare(sys.argv[1]), lifespan="on"),
                         f"TRACETRAIN_GATEWAY_URL=http://{host}:{port}")
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
