"""`upstream` engine: an OpenAI-compatible server (vLLM) asked for exact token ids.

One turn is one `POST {base_url}/v1/completions` with the prompt as a list of token ids:

    {"model": M, "prompt": [ids], "max_tokens": N, "temperature": T, "top_p": P, "seed": S,
     "stop_token_ids": [...], "stop": [strings], "logprobs": 1, "return_tokens_as_token_ids": true,
     "n": 1, "stream": false, "structured_outputs": {...}}

(`structured_outputs`, vLLM's constrained decoding, only when SamplingParams.structured is set:
{"json": schema}, {"json_object": true} or {"structural_tag": "<JSON text>"}; checked with
vLLM 0.32.)

and the turn is read from `choices[0]`:

    logprobs.tokens           -> Generation.response_ids: "token_id:N" strings, one per token
                                 generated (the stop token included, as vLLM returns it)
    logprobs.token_logprobs   -> Generation.response_logprobs (one per token id)
    finish_reason             -> "stop" | "length"

(Not `return_token_ids`: with it vLLM also sends back the whole prompt's ids, which the gateway
already has: both sides would write and read them for nothing.)

SGLang (`api="sglang"`) is asked through its native `POST {base_url}/generate` (no constrained
decoding: `constrains` is False, and params with `structured` are refused):

    {"input_ids": [ids], "sampling_params": {"max_new_tokens": N, "temperature": T, "top_p": P,
     "stop_token_ids": [...], "stop": [strings], "sampling_seed": S}, "return_logprob": true,
     "stream": false}
    -> meta_info.output_token_logprobs = [[logprob, id, text], ...], meta_info.finish_reason.type

Streamed (`generate(..., on_tokens)`, vLLM only): the same body with `"stream": true`, answered as
server-sent events, `data: {chunk}` lines ending with `data: [DONE]` (`: keep-alive` comments
ignored). Each chunk is a completion whose `choices[0]` holds the NEW tokens only (one engine
step's, usually one):

    logprobs.tokens           -> the run of ids handed to on_tokens
    logprobs.token_logprobs   -> one per new token id
    finish_reason             -> null until the last chunk, then "stop" | "length"

A chunk `{"error": {"message", "code"}}` is the server's failure mid-stream; a chunk with empty
`choices` (usage) adds nothing. SGLang ignores on_tokens (never calls it): its answer comes whole.

Which distribution the logprobs come from is the server's choice: vLLM V1 returns raw
log-softmax(logits) by default; start it with `--logprobs-mode processed_logprobs` to get the
temperature-scaled log-probabilities the local engine returns (identical when top_p == 1).

Failures: connection errors, timeouts, 429 and 5xx are retried `max_retries` times with
exponential backoff (`backoff * 2**k` seconds, capped at `backoff_max`); then `EngineError` with
status 503 (unreachable / overloaded), 504 (timed out) or 502 (bad answer). A 400 that says the
context is too long is `PromptTooLong`; other 4xx are not retried (502: we built a bad request).
A stream is retried the same way until its first token id is handed to on_tokens; after that a
failure (dropped, timed out, an error chunk) is `EngineError` at once: tokens cannot be taken back.
Cancelling `generate` closes the connection, which makes vLLM abort the request.

The HTTP client is aiohttp with one pooled session per engine: on the shared 2-core dev machine,
at 32 concurrent requests against the fake upstream, it made 5-10x the requests/s of httpx, whose
connection pool scans every connection on each request (bench/bench_engine_upstream.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from tracetrain.engines.base import (
    EngineError,
    Generation,
    OnTokens,
    PromptTooLong,
    SamplingParams,
    check_sampling_params,
)

_JSON = {"Content-Type": "application/json"}
_TOO_LONG = re.compile(
    r"maximum context length|max_model_len|context length|too long|longer than", re.IGNORECASE
)


def _check_positive(
    name: str, value: Any, *, allow_zero: bool = False, integer: bool = False
) -> None:
    kind = int if integer else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(
            f"{name} must be {'an int' if integer else 'a number'} {bound}, got {value!r}"
        )


def request_body(model: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The JSON body of one vLLM completions call for exact token ids."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "n": 1,
        "stream": False,
        "logprobs": 1,  # vLLM always adds the sampled token's logprob to the top-k
        "return_tokens_as_token_ids": True,  # logprobs.tokens: "token_id:N"
    }
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed
    if params.structured is not None:
        body["structured_outputs"] = params.structured
    return body


def _ids_and_logprobs(choice: Any) -> tuple[list[int], list[float]]:
    """choices[0]'s token ids (from logprobs.tokens, "token_id:N") and their logprobs; ValueError
    naming the field if malformed."""
    if not isinstance(choice, dict):
        raise ValueError(f"choices[0] is {type(choice).__name__}, not an object")
    logprobs = choice.get("logprobs")
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    try:
        if not isinstance(tokens, list):
            raise TypeError
        ids = [int(t[9:]) if t.startswith("token_id:") else -1 for t in tokens]
        if any(t < 0 for t in ids):
            raise ValueError
    except (TypeError, ValueError, AttributeError):
        raise ValueError(
            "choices[0].logprobs.tokens is missing or not a list of 'token_id:N' strings "
            "(the server must support logprobs with return_tokens_as_token_ids, as vLLM does)"
        ) from None
    lp = logprobs.get("token_logprobs")
    if not isinstance(lp, list) or len(lp) != len(ids):
        raise ValueError(
            f"choices[0].logprobs.token_logprobs has {len(lp) if isinstance(lp, list) else 'no'} "
            f"values for {len(ids)} token ids"
        )
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in lp):
        raise ValueError("choices[0].logprobs.token_logprobs holds a non-number")
    return ids, [float(v) for v in lp]


def _finish(choice: dict, *, final: bool) -> str | None:
    """choices[0].finish_reason: "stop" | "length", or None too where the answer is not final."""
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length") and (final or finish is not None):
        raise ValueError(f"choices[0].finish_reason is {finish!r}, expected 'stop' or 'length'")
    return finish


def parse_choice(payload: Any) -> tuple[list[int], list[float], str]:
    """(token ids, logprobs, finish reason) from a completions response; ValueError if malformed."""
    if (
        not isinstance(payload, dict)
        or not isinstance(payload.get("choices"), list)
        or not payload["choices"]
    ):
        raise ValueError("response has no choices")
    choice = payload["choices"][0]
    ids, lp = _ids_and_logprobs(choice)
    return ids, lp, _finish(choice, final=True)


def parse_chunk(payload: Any) -> tuple[list[int], list[float], str | None]:
    """(new token ids, their logprobs, finish reason or None before the last chunk) from one
    streamed completions chunk; ValueError if malformed. A chunk with empty choices (usage) adds
    nothing."""
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        raise ValueError("stream chunk has no choices")
    if not payload["choices"]:
        return [], [], None
    choice = payload["choices"][0]
    ids, lp = _ids_and_logprobs(choice)
    return ids, lp, _finish(choice, final=False)


def sglang_request_body(
    model: str, prompt_ids: list[int], params: SamplingParams
) -> dict[str, Any]:
    """The JSON body of one SGLang /generate call (`model` is unused: one model per server)."""
    sp: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        sp["stop"] = list(params.stop)
    if params.seed is not None:
        sp["sampling_seed"] = params.seed
    return {"input_ids": prompt_ids, "sampling_params": sp, "return_logprob": True, "stream": False}


def parse_sglang(payload: Any) -> tuple[list[int], list[float], str]:
    """(token ids, logprobs, finish reason) from a /generate answer; ValueError if malformed."""
    meta = payload.get("meta_info") if isinstance(payload, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("response has no meta_info")
    pairs = meta.get("output_token_logprobs")
    if not isinstance(pairs, list) or not all(isinstance(x, list) and len(x) >= 2 for x in pairs):
        raise ValueError(
            "meta_info.output_token_logprobs is missing or not [[logprob, id, ...], ...]"
        )
    ids, lp = [x[1] for x in pairs], [x[0] for x in pairs]
    if not all(type(t) is int and t >= 0 for t in ids):
        raise ValueError("meta_info.output_token_logprobs holds an id that is not a token id")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in lp):
        raise ValueError("meta_info.output_token_logprobs holds a logprob that is not a number")
    finish = (meta.get("finish_reason") or {}).get("type")
    if finish not in ("stop", "length"):
        raise ValueError(f"meta_info.finish_reason.type is {finish!r}, expected 'stop' or 'length'")
    return ids, [float(v) for v in lp], finish


# api name -> (path, request body, answer parser)
PROTOCOLS = {
    "vllm": ("/v1/completions", request_body, parse_choice),
    "sglang": ("/generate", sglang_request_body, parse_sglang),
}


def _error_message(status: int, raw: bytes) -> str:
    """vLLM answers {"error": {"message": ...}} (newer) or {"message": ...} (older)."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        for key in ("message", "detail"):
            if isinstance(body.get(key), str):
                return body[key]
    return raw[:500].decode(errors="replace") or f"HTTP {status}"


class _Retry(Exception):
    """A failure that another attempt may not have: `status` is the answer if it is the last."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class UpstreamEngine:
    """Engine over a vLLM (`api="vllm"`) or SGLang (`api="sglang"`) server; see the module
    docstring for the protocols.

    `model_version` is a plain attribute: the trainer sets it after it syncs weights to the server.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Any,
        *,
        name: str = "upstream",
        max_context: int,
        api_key: str | None = None,
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff: float = 0.1,
        backoff_max: float = 5.0,
        max_connections: int = 256,
        model_version: int = 0,
        api: str = "vllm",
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty str, got {model!r}")
        _check_positive("max_context", max_context, integer=True)
        _check_positive("timeout", timeout)
        _check_positive("max_retries", max_retries, allow_zero=True, integer=True)
        _check_positive("backoff", backoff, allow_zero=True)
        _check_positive("backoff_max", backoff_max, allow_zero=True)
        _check_positive("max_connections", max_connections, integer=True)
        if api not in PROTOCOLS:
            raise ValueError(f"api {api!r} is unknown; known: {', '.join(PROTOCOLS)}")
        self.api = api
        self.constrains = api == "vllm"  # vLLM's structured_outputs; SGLang's format is not used
        path, self._body, self._parse = PROTOCOLS[api]
        self.base_url = base_url.rstrip("/")
        self._url = self.base_url + path
        self.served_model = model  # the name the server serves it under
        # several policies (vLLM multi-LoRA): SamplingParams.adapter -> the model name it is served as
        self.adapter_models: dict[str, str] = {}
        self.tokenizer = tokenizer
        self.name = name
        self.max_context = max_context
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.backoff = float(backoff)
        self.backoff_max = float(backoff_max)
        self.model_version = model_version
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failures": 0}

    def _http(self) -> aiohttp.ClientSession:
        """One pooled session per engine, made inside the event loop that uses it (a session is
        bound to its loop; a call from another loop gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._loop = loop
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(
                    total=self.timeout, sock_connect=min(self.timeout, 10.0)
                ),
                connector=aiohttp.TCPConnector(limit=self._max_connections),
            )
        return self._session

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError on bad params; PromptTooLong if prompt + max_tokens exceeds max_context."""
        check_sampling_params(params, constrains=self.constrains, adapters=tuple(self.adapter_models))
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; a prompt needs at least one token id")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_context:
            raise PromptTooLong(
                f"prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{need} > the engine's max_context {self.max_context}"
            )

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_tokens: OnTokens | None = None
    ) -> Generation:
        """The turn for exact prompt ids, retried as the module docstring says. With `on_tokens`
        (vLLM only; SGLang never calls it) the answer is streamed and each run of new ids handed
        to it as it arrives."""
        self.check(prompt_ids, params)
        model = self.served_model if params.adapter is None else self.adapter_models[params.adapter]
        body = self._body(model, prompt_ids, params)
        if on_tokens is not None and self.api == "vllm":
            body["stream"] = True
        else:
            on_tokens = None
        payload = orjson.dumps(body)  # ids: C speed
        version = self.model_version  # the version that served this request
        (ids, logprobs, finish), n = await self.retried(lambda: self._attempt(payload, on_tokens))
        return Generation(ids, logprobs, finish, version, extra={"attempts": n})

    async def retried(self, attempt: Callable[[], Awaitable[Any]], what: str = "") -> tuple[Any, int]:
        """(`await attempt()`, the attempts it took): tried again on _Retry, max_retries times
        with exponential backoff (module docstring); EngineError when every try failed (`what`
        says what was asked). One request in `stats` (engines/score.py asks through it too)."""
        self.stats["requests"] += 1
        last = _Retry(502, "")
        for k in range(self.max_retries + 1):
            if k:
                self.stats["retries"] += 1
                await asyncio.sleep(min(self.backoff_max, self.backoff * 2 ** (k - 1)))
            self.stats["attempts"] += 1
            try:
                return await attempt(), k + 1
            except _Retry as e:
                last = e
            except EngineError:
                self.stats["failures"] += 1
                raise
        self.stats["failures"] += 1
        raise EngineError(f"upstream {self.name!r} at {self.base_url} failed after "
                          f"{self.max_retries + 1} attempts{what}: {last}", last.status)

    async def _attempt(
        self, payload: bytes, on_tokens: OnTokens | None
    ) -> tuple[list[int], list[float], str]:
        """One request: the parsed turn, or _Retry, PromptTooLong or EngineError."""
        if on_tokens is None:
            answer = await self.post_json(payload)
            try:
                return self._parse(answer)
            except ValueError as e:  # a malformed answer will not get better by asking again
                raise self._bad_answer(e) from None
        try:
            async with self._http().post(self._url, data=payload, headers=_JSON) as response:
                if response.status == 200:
                    return await self._stream(response, on_tokens)
                code, raw = response.status, await response.read()
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise self._retry(e) from None
        raise self._refusal(code, _error_message(code, raw))

    async def post_json(self, payload: bytes) -> Any:
        """One POST of `payload` to the protocol's route: the answer's JSON, or _Retry,
        PromptTooLong or EngineError (engines/score.py asks through it too)."""
        try:
            async with self._http().post(self._url, data=payload, headers=_JSON) as response:
                code, raw = response.status, await response.read()
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise self._retry(e) from None
        if code != 200:
            raise self._refusal(code, _error_message(code, raw))
        try:
            return orjson.loads(raw)
        except ValueError as e:
            raise self._bad_answer(e) from None

    async def _stream(
        self, response: aiohttp.ClientResponse, on_tokens: OnTokens
    ) -> tuple[list[int], list[float], str]:
        """Read a streamed answer (SSE) to its end, handing each chunk's new ids to on_tokens. A
        failure before the first id is raised as for a whole answer; after it, as EngineError."""
        ids: list[int] = []
        logprobs: list[float] = []
        finish = None
        tail = b""
        try:
            async for piece in response.content.iter_any():  # not readline: it limits a line
                *lines, tail = (tail + piece).split(b"\n")
                for line in lines:
                    # skipped: the blank line after each event, `: keep-alive` comments, [DONE]
                    if line.startswith(b"data:") and (data := line[5:].strip()) != b"[DONE]":
                        new, new_logprobs, end = self._chunk(data)
                        finish = end or finish  # a usage chunk may follow the last one
                        if new:
                            ids += new
                            logprobs += new_logprobs
                            on_tokens(new)
        except (asyncio.TimeoutError, aiohttp.ClientError, _Retry) as e:
            retry = e if isinstance(e, _Retry) else self._retry(e)
            if not ids:
                raise retry from None
            raise EngineError(
                f"upstream {self.name!r} failed after streaming {len(ids)} tokens (not retried): "
                f"{retry}",
                retry.status,
            ) from None
        if finish is None:
            raise self._bad_answer("the stream ended without a choices[0].finish_reason")
        return ids, logprobs, finish

    def _chunk(self, data: bytes) -> tuple[list[int], list[float], str | None]:
        """parse_chunk of one `data:` payload (EngineError 502 if malformed), or the server's
        error chunk raised as _Retry, PromptTooLong or EngineError."""
        try:
            payload = orjson.loads(data)
            err = payload.get("error") if isinstance(payload, dict) else None
            if not isinstance(err, dict):
                return parse_chunk(payload)
        except ValueError as e:  # orjson's JSONDecodeError is one
            raise self._bad_answer(e) from None
        code = err.get("code")
        raise self._refusal(code if type(code) is int else 500, str(err.get("message")))

    def _retry(self, e: Exception) -> _Retry:
        if isinstance(e, asyncio.TimeoutError):  # aiohttp's timeouts subclass it
            return _Retry(504, f"timed out after {self.timeout:g} s ({type(e).__name__})")
        return _Retry(503, f"{type(e).__name__}: {e}")  # refused, reset, dropped mid-answer

    def _bad_answer(self, why: object) -> EngineError:
        return EngineError(f"upstream {self.name!r} gave a bad answer: {why}", 502)

    def _refusal(self, code: int, message: str) -> Exception:
        """An error answer as _Retry (429, 5xx), PromptTooLong or EngineError (502)."""
        if code == 429 or code >= 500:
            return _Retry(503 if code in (429, 503) else 502, f"HTTP {code}: {message}")
        if code == 400 and _TOO_LONG.search(message):
            return PromptTooLong(f"upstream {self.name!r}: {message}")
        return EngineError(
            f"upstream {self.name!r} refused the request: HTTP {code}: {message}", 502
        )

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
