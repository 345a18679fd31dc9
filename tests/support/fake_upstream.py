"""A fake vLLM OpenAI-compatible server, for tests and benchmarks (it stands in for a GPU server).

It speaks vLLM's wire protocol (>= 0.10.2) for `/v1/completions` and `/v1/chat/completions`
(and SGLang's native `/generate`: input_ids, meta_info.output_token_logprobs),
non-streaming and SSE: token-id prompts, `return_token_ids` (choices[0].token_ids and
prompt_token_ids), completions logprobs (`logprobs.token_logprobs`; `logprobs.tokens` as
"token_id:N" with `return_tokens_as_token_ids`) and chat logprobs
(`logprobs.content[].logprob`), `finish_reason`, `usage`, and vLLM's 400 for a prompt over the
context. Generation is a pure function of (prompt ids, seed, max_tokens, stop ids): see
`fake_generation`, which tests use as the oracle.

Text is faked too: a text prompt is tokenized as one id per UTF-8 byte (byte + 3); an id
decodes to one letter. `stop` strings end an answer (completions) at the token whose letter
completes one, as vLLM's do. Failure injection: `fail_first` requests answer `fail_status` (a code,
or 0 = drop the connection mid-answer), every answer waits `delay_s`. A streamed completion sends
one token per chunk, as vLLM does (`completion_chunks`), each after `token_delay_s`; `stats
["streams_cut"]` counts the streams whose client went away before their end. Change these at run
time with `POST /fake/config {...}`; read counters at `GET /fake/stats`, and the body of the last
generation request at `GET /fake/last_request` (`app.state.last_request`; null before the first).
A completion's `structured_outputs` (vLLM's constrained decoding) is checked for vLLM's shape
(exactly one constraint; `structural_tag` a JSON string of an object) and otherwise ignored.

    with FakeUpstream(response_len=8) as fake:          # in a thread of this process
        httpx.post(fake.url + "/v1/completions", json={...})
    python tests/support/fake_upstream.py --port 0               # prints FAKE_UPSTREAM_URL=http://...
    proc, url = spawn_fake_upstream(fail_first=2)        # the same, as a subprocess
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import socket
import subprocess
import sys
import threading
import time
import zlib
from array import array
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

FIRST_TOKEN = 3  # ids 0..2 are the tiny tokenizer's special tokens; generated ids are >= 3


@dataclass
class FakeConfig:
    model: str = "fake"
    vocab_size: int = 512
    eos_id: int = 2  # <|im_end|> in tracetrain.models.tiny
    response_len: int = (
        8  # natural length, eos included (shorter when max_tokens or a stop id cuts it)
    )
    max_model_len: int = 4096
    fail_first: int = 0  # the first k generation requests fail...
    fail_status: int = 500  # ...with this HTTP status, or 0: the connection drops mid-answer
    delay_s: float = 0.0  # every generation request waits this long first
    token_delay_s: float = 0.0  # a streamed answer waits this long before each chunk
    # Scripted answers (set with POST /fake/config): generation request k of a route answers
    # replies[k % len(replies)] (token ids, cut at max_tokens) instead of random ids.
    replies: list | None = None


def fake_generation(
    prompt_ids: list[int],
    max_tokens: int,
    *,
    seed: int | None = None,
    stop_token_ids: tuple[int, ...] | list[int] = (),
    config: FakeConfig | None = None,
) -> tuple[list[int], list[float], str]:
    """(token ids, logprobs, finish reason): random ids seeded by crc32(prompt) ^ seed; token
    `response_len - 1` is eos; it stops after eos or a stop id ("stop"), or at max_tokens ("length")."""
    cfg = config or FakeConfig()
    rng = random.Random(zlib.crc32(array("q", prompt_ids).tobytes()) ^ (seed or 0))
    stops = {cfg.eos_id, *stop_token_ids}
    ids: list[int] = []
    logprobs: list[float] = []
    for k in range(max_tokens):
        tok = (
            cfg.eos_id if k == cfg.response_len - 1 else rng.randrange(FIRST_TOKEN, cfg.vocab_size)
        )
        ids.append(tok)
        logprobs.append(-4.0 * rng.random())
        if tok in stops:
            return ids, logprobs, "stop"
    return ids, logprobs, "length"


def _stop_strings(ids, lps, finish, stop):
    """vLLM's `stop` strings: the answer ends with the token whose text completes one."""
    if not stop:
        return ids, lps, finish
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a string or a list of non-empty strings", param="stop")
    for k in range(len(ids)):
        if any(s in fake_detokenize(ids[: k + 1]) for s in stops):
            return ids[: k + 1], lps[: k + 1], "stop"
    return ids, lps, finish


def fake_tokenize(text: str) -> list[int]:
    return [b + FIRST_TOKEN for b in text.encode()]


def fake_detokenize(ids: list[int]) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


def render_messages(messages: list[dict]) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role')}\n{content or ''}\n")
    return "".join(parts) + "assistant\n"


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def _json(body: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(body, separators=(",", ":")).encode(), status, media_type="application/json"
    )


def _error(message: str, status: int, param: str | None = None) -> Response:
    kind = (
        "BadRequestError"
        if status == 400
        else "NotFoundError"
        if status == 404
        else "InternalServerError"
    )
    return _json(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status
    )


def _int(body: dict, name: str, default: int | None, lo: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BadRequest(f"{name} must be an int >= {lo}, got {v!r}", param=name)
    return v


def _params(
    body: dict, cfg: FakeConfig, prompt_ids: list[int]
) -> tuple[int, int | None, list[int]]:
    """(max_tokens, seed, stop ids) checked like vLLM does; 400 for a prompt over the context."""
    if prompt_ids and not (0 <= min(prompt_ids) and max(prompt_ids) < cfg.vocab_size):
        i = next(i for i in prompt_ids if not 0 <= i < cfg.vocab_size)
        raise BadRequest(f"Token id {i} is out of vocabulary", param="prompt")
    room = cfg.max_model_len - len(prompt_ids)
    max_tokens = _int(body, "max_completion_tokens", None, 1) or _int(body, "max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = max(room, 1)  # vLLM's default: all the room left
    if len(prompt_ids) + max_tokens > cfg.max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
            f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            param="input_tokens",
        )
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(type(i) is int for i in stops):
        raise BadRequest("stop_token_ids must be a list of int", param="stop_token_ids")
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise BadRequest("seed must be an int", param="seed")
    return max_tokens, seed, stops


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _check_structured(so: Any) -> None:
    """vLLM's checks of structured_outputs (StructuredOutputsParams): one constraint, the
    structural tag as JSON text of an object."""
    if so is None:
        return
    kinds = [k for k in STRUCTURED_KINDS if isinstance(so, dict) and so.get(k) is not None]
    if len(kinds) != 1:
        raise BadRequest("structured_outputs needs exactly one constraint",
                         param="structured_outputs")
    tag = so.get("structural_tag")
    try:
        ok = tag is None or isinstance(json.loads(tag), dict)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise BadRequest("Invalid structured_outputs structural_tag specification.",
                         param="structured_outputs")


class _DroppedResponse(Response):
    """Starts a 200 answer, sends a few bytes of it, then fails: uvicorn closes the connection."""

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"64")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"id": "cut', "more_body": True})
        raise ConnectionAbortedError("fake upstream: connection dropped mid-answer")


def _usage(prompt_ids: list[int], ids: list[int]) -> dict:
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt_ids) + len(ids),
    }


def _sse(chunks: list[dict], delay_s: float, stats: dict) -> StreamingResponse:
    """The chunks as server-sent events, each after delay_s, then [DONE]; a stream whose client
    goes away first (Starlette cancels it) counts in stats["streams_cut"]."""

    async def gen():
        ended = False
        try:
            for c in chunks:
                if delay_s:
                    await asyncio.sleep(delay_s)
                yield b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            ended = True
        finally:
            if not ended:
                stats["streams_cut"] += 1

    return StreamingResponse(gen(), media_type="text/event-stream")


def _token_names(body: dict, ids: list[int]) -> list[str]:
    """Completions logprobs' `tokens`: each id's text, or "token_id:N" with
    return_tokens_as_token_ids (vLLM's _create_completion_logprobs)."""
    if body.get("return_tokens_as_token_ids"):
        return [f"token_id:{i}" for i in ids]
    return [fake_detokenize([i]) for i in ids]


def completion_chunks(
    head: dict, prompt_ids: list[int], ids: list[int], lps: list[float], finish: str, body: dict
) -> list[dict]:
    """vLLM's streamed completion (serving.py, completion_stream_generator): one chunk per new
    token; each choice carries its new text, token_ids and logprobs (null unless asked for);
    prompt_token_ids on the first chunk only, finish_reason on the last; then a usage chunk with
    empty choices if stream_options.include_usage."""
    want_ids = bool(body.get("return_token_ids"))
    chunks = []
    for k, (i, lp) in enumerate(zip(ids, lps, strict=True)):
        token = fake_detokenize([i])
        logprobs = None
        if body.get("logprobs") is not None:
            (name,) = _token_names(body, [i])
            logprobs = {
                "text_offset": [k],
                "token_logprobs": [lp],
                "tokens": [name],
                "top_logprobs": [{name: lp}],
            }
        choice = {
            "index": 0,
            "text": token,
            "logprobs": logprobs,
            "finish_reason": finish if k == len(ids) - 1 else None,
            "stop_reason": None,
            "prompt_token_ids": prompt_ids if want_ids and k == 0 else None,
            "token_ids": [i] if want_ids else None,
        }
        chunks.append(dict(head, choices=[choice]))
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(dict(head, choices=[], usage=_usage(prompt_ids, ids)))
    return chunks


def make_app(config: FakeConfig | None = None) -> FastAPI:
    cfg = config or FakeConfig()
    stats = {
        "requests": 0,
        "completions": 0,
        "chat": 0,
        "generate": 0,
        "failed": 0,
        "bad_requests": 0,
        "streams_cut": 0,
    }
    app = FastAPI(title="fake vLLM upstream", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.config, app.state.stats = cfg, stats
    app.state.last_request = None
    counter = iter(range(1 << 62))

    async def gate(kind: str) -> Response | None:
        """Count the request, wait delay_s, inject a failure while fail_first lasts."""
        stats["requests"] += 1
        stats[kind] += 1
        if cfg.delay_s:
            await asyncio.sleep(cfg.delay_s)
        if stats["failed"] < cfg.fail_first:
            stats["failed"] += 1
            if cfg.fail_status == 0:
                return _DroppedResponse()
            return _error(f"fake upstream: injected failure {stats['failed']}", cfg.fail_status)
        return None

    async def read_body(request: Request, generation: bool = True) -> dict:
        try:
            body = orjson.loads(await request.body())
        except ValueError as e:
            raise BadRequest(f"body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        if generation and body.get("n", 1) != 1:
            raise BadRequest("this fake serves n=1 only", param="n")
        if generation:
            app.state.last_request = body
        return body

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, e: BadRequest):
        stats["bad_requests"] += 1
        return _error(str(e), e.status, e.param)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        if (failed := await gate("completions")) is not None:
            return failed
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_ids = fake_tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt):
            prompt_ids = prompt
        else:
            raise BadRequest(
                "prompt must be a string or a non-empty list of token ids", param="prompt"
            )
        max_tokens, seed, stops = _params(body, cfg, prompt_ids)
        _check_structured(body.get("structured_outputs"))
        if cfg.replies:
            ids = list(cfg.replies[(stats["completions"] - 1) % len(cfg.replies)])[:max_tokens]
            lps = [-0.5] * len(ids)
            finish = "stop" if ids[-1] in {cfg.eos_id, *stops} else "length"
        else:
            ids, lps, finish = fake_generation(
                prompt_ids, max_tokens, seed=seed, stop_token_ids=stops, config=cfg
            )
        ids, lps, finish = _stop_strings(ids, lps, finish, body.get("stop"))
        head = {
            "id": f"cmpl-{next(counter)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", cfg.model),
        }
        if body.get("stream"):
            chunks = completion_chunks(head, prompt_ids, ids, lps, finish, body)
            return _sse(chunks, cfg.token_delay_s, stats)
        text = fake_detokenize(ids)
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        if body.get("logprobs") is not None:
            tokens = _token_names(body, ids)
            choice["logprobs"] = {
                "text_offset": list(range(len(ids))),
                "token_logprobs": lps,
                "tokens": tokens,
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=True)],
            }
        if body.get("return_token_ids"):
            choice["token_ids"], choice["prompt_token_ids"] = ids, prompt_ids
        return _json(dict(head, choices=[choice], usage=_usage(prompt_ids, ids)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request)
        if (failed := await gate("chat")) is not None:
            return failed
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise BadRequest("messages must be a non-empty list of objects", param="messages")
        prompt_ids = fake_tokenize(render_messages(messages))
        max_tokens, seed, stops = _params(body, cfg, prompt_ids)
        if cfg.replies:
            ids = list(cfg.replies[(stats["chat"] - 1) % len(cfg.replies)])[:max_tokens]
            lps = [-0.5] * len(ids)
            finish = "stop" if ids[-1] in {cfg.eos_id, *stops} else "length"
        else:
            ids, lps, finish = fake_generation(
                prompt_ids, max_tokens, seed=seed, stop_token_ids=stops, config=cfg
            )
        text = fake_detokenize(ids)
        logprobs = None
        if body.get("logprobs"):
            logprobs = {
                "content": [
                    {
                        "token": fake_detokenize([i]),
                        "logprob": lp,
                        "bytes": list(fake_detokenize([i]).encode()),
                        "top_logprobs": [],
                    }
                    for i, lp in zip(ids, lps, strict=True)
                ]
            }
        want_ids = bool(body.get("return_token_ids"))
        head = {
            "id": f"chatcmpl-{next(counter)}",
            "created": int(time.time()),
            "model": body.get("model", cfg.model),
        }
        if body.get("stream"):
            first: dict[str, Any] = {
                "index": 0,
                "delta": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": None,
            }
            last: dict[str, Any] = {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            if want_ids:
                first["token_ids"], last["token_ids"] = ids, []
            chunk = dict(head, object="chat.completion.chunk")
            chunks = [
                dict(
                    chunk, choices=[first], **({"prompt_token_ids": prompt_ids} if want_ids else {})
                ),
                dict(chunk, choices=[last]),
            ]
            if (body.get("stream_options") or {}).get("include_usage"):
                chunks.append(dict(chunk, choices=[], usage=_usage(prompt_ids, ids)))
            return _sse(chunks, cfg.token_delay_s, stats)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": None,
        }
        if want_ids:
            choice["token_ids"] = ids
        out = dict(head, object="chat.completion", choices=[choice], usage=_usage(prompt_ids, ids))
        out["prompt_token_ids"] = prompt_ids if want_ids else None
        return _json(out)

    @app.post("/generate")
    async def sglang_generate(request: Request):
        """SGLang's native endpoint: input_ids in, meta_info.output_token_logprobs out."""
        body = await read_body(request)
        if (failed := await gate("generate")) is not None:
            return failed
        prompt_ids, sp = body.get("input_ids"), body.get("sampling_params") or {}
        if (
            not isinstance(prompt_ids, list)
            or not prompt_ids
            or not all(type(i) is int for i in prompt_ids)
        ):
            raise BadRequest("input_ids must be a non-empty list of token ids", param="input_ids")
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object", param="sampling_params")
        max_new = _int(sp, "max_new_tokens", 128, 1)
        if len(prompt_ids) + max_new > cfg.max_model_len:
            raise BadRequest(
                f"The input ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new}) is longer "
                f"than the model's context length ({cfg.max_model_len} tokens)."
            )
        _, seed, stops = _params(
            {
                "max_tokens": max_new,
                "seed": sp.get("sampling_seed"),
                "stop_token_ids": sp.get("stop_token_ids"),
            },
            cfg,
            prompt_ids,
        )
        ids, lps, finish = fake_generation(
            prompt_ids, max_new, seed=seed, stop_token_ids=stops, config=cfg
        )
        reason = (
            {"type": "stop", "matched": ids[-1]}
            if finish == "stop"
            else {"type": "length", "length": len(ids)}
        )
        meta: dict[str, Any] = {
            "id": f"gen-{next(counter)}",
            "finish_reason": reason,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, i, None] for lp, i in zip(lps, ids, strict=True)]
        return _json({"text": fake_detokenize(ids), "output_ids": ids, "meta_info": meta})

    @app.get("/v1/models")
    async def models():
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "owned_by": "fake",
                        "max_model_len": cfg.max_model_len,
                    }
                ],
            }
        )

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    # vLLM's dev routes for RL (VLLM_SERVER_DEV_MODE=1: weight transfer, reload, sleep): the
    # route (with its query) and JSON body recorded in order, at GET /fake/weight_calls;
    # /get_world_size answers world_size (TP x PP x DP) 1.
    weight_calls: list[tuple[str, Any]] = []
    app.state.weight_calls = weight_calls

    def record(route: str):
        async def handler(request: Request):
            raw = await request.body()
            query = f"?{request.url.query}" if request.url.query else ""
            weight_calls.append((route + query, json.loads(raw) if raw else None))
            return _json({"message": f"fake {route}"})
        app.post(route)(handler)

    for route in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                  "/finish_weight_update", "/reset_prefix_cache", "/collective_rpc", "/sleep",
                  "/wake_up", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        record(route)

    @app.get("/get_world_size")
    async def world_size():
        return _json({"world_size": 1})

    @app.get("/fake/weight_calls")
    async def get_weight_calls():
        return _json(weight_calls)

    @app.get("/fake/stats")
    async def get_stats():
        return _json(stats)

    @app.get("/fake/last_request")
    async def get_last_request():
        return _json(app.state.last_request)

    @app.post("/fake/config")
    async def set_config(request: Request):
        """Set config fields (unknown keys are a 400); the counters restart from 0."""
        body = await read_body(request, generation=False)
        names = {f.name for f in dataclasses.fields(FakeConfig)}
        if unknown := set(body) - names:
            raise BadRequest(f"unknown config keys {sorted(unknown)}; known: {sorted(names)}")
        for k, v in body.items():
            setattr(cfg, k, v)
        stats.update(dict.fromkeys(stats, 0))
        return _json(dataclasses.asdict(cfg))

    return app


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _server(app: FastAPI, **kw) -> uvicorn.Server:
    config = uvicorn.Config(
        app, log_level="critical", access_log=False, lifespan="off", http="httptools", **kw
    )
    return uvicorn.Server(config)


class FakeUpstream:
    """The fake served by uvicorn in a background thread of this process on 127.0.0.1:<free port>.
    `config` is live: change its fields (e.g. fail_first) while it runs; `stats` counts requests."""

    def __init__(self, **config: Any):
        self.config = FakeConfig(**config)
        self.app = make_app(self.config)
        self.stats: dict[str, int] = self.app.state.stats
        self._sock = _listen("127.0.0.1", 0)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = _server(self.app)
        self._thread: threading.Thread | None = None

    def start(self) -> FakeUpstream:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake upstream did not start within 10 s")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> FakeUpstream:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def spawn_fake_upstream(
    python: str = sys.executable, timeout: float = 30.0, **config: Any
) -> tuple[subprocess.Popen, str]:
    """Start `python tests/support/fake_upstream.py --port 0 ...` and return (process, base URL)."""
    args = [python, __file__, "--port", "0"]
    for k, v in config.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("FAKE_UPSTREAM_URL="):
            return proc, line.strip().split("=", 1)[1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"fake upstream subprocess did not start within {timeout} s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, default=0, help="0: a free port (printed as FAKE_UPSTREAM_URL=...)"
    )
    for f in dataclasses.fields(FakeConfig):
        if f.default is None:  # JSON values: POST /fake/config
            continue
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    a = p.parse_args(argv)
    cfg = FakeConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(FakeConfig)
                        if f.default is not None})
    sock = _listen(a.host, a.port)
    print(f"FAKE_UPSTREAM_URL=http://{a.host}:{sock.getsockname()[1]}", flush=True)
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    _server(make_app(cfg), loop=loop).run(sockets=[sock])


if __name__ == "__main__":
    main()
