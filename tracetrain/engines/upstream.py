"""`upstream` engine: an OpenAI-compatible server (vLLM >= 0.10.2) asked for exact token ids.

One turn is one `POST {base_url}/v1/completions` with the prompt as a list of token ids:

    {"model": M, "prompt": [ids], "max_tokens": N, "temperature": T, "top_p": P, "seed": S,
     "stop_token_ids": [...], "stop": [strings], "logprobs": 1, "return_token_ids": true, "n": 1,
     "stream": false}

and the turn is read from `choices[0]`:

    token_ids                 -> Generation.response_ids (the stop token included, as vLLM returns it)
    logprobs.token_logprobs   -> Generation.response_logprobs (one per token id)
    finish_reason             -> "stop" | "length"

SGLang (`api="sglang"`) is asked through its native `POST {base_url}/generate`:

    {"input_ids": [ids], "sampling_params": {"max_new_tokens": N, "temperature": T, "top_p": P,
     "stop_token_ids": [...], "stop": [strings], "sampling_seed": S}, "return_logprob": true,
     "stream": false}
    -> meta_info.output_token_logprobs = [[logprob, id, text], ...], meta_info.finish_reason.type

Which distribution the logprobs come from is the server's choice: vLLM V1 returns raw
log-softmax(logits) by default; start it with `--logprobs-mode processed_logprobs` to get the
temperature-scaled log-probabilities the local engine returns (identical when top_p == 1).

Failures: connection errors, timeouts, 429 and 5xx are retried `max_retries` times with
exponential backoff (`backoff * 2**k` seconds, capped at `backoff_max`); then `EngineError` with
status 503 (unreachable / overloaded), 504 (timed out) or 502 (bad answer). A 400 that says the
context is too long is `PromptTooLong`; other 4xx are not retried (502: we built a bad request).

The HTTP client is aiohttp with one pooled session per engine: on the shared 2-core dev machine,
at 32 concurrent requests against the fake upstream, it made 5-10x the requests/s of httpx, whose
connection pool scans every connection on each request (bench/bench_engine_upstream.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

import aiohttp
import orjson

from tracetrain.engines.base import (
    EngineError,
    Generation,
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
        "return_token_ids": True,
    }
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed
    return body


def parse_choice(payload: Any) -> tuple[list[int], list[float], str]:
    """(token ids, logprobs, finish reason) from a completions response; ValueError if malformed."""
    if (
        not isinstance(payload, dict)
        or not isinstance(payload.get("choices"), list)
        or not payload["choices"]
    ):
        raise ValueError("response has no choices")
    choice = payload["choices"][0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise ValueError(
            "choices[0].token_ids is missing or not a list of token ids "
            "(the server must support return_token_ids: vLLM >= 0.10.2)"
        )
    lp = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(lp, list) or len(lp) != len(ids):
        raise ValueError(
            f"choices[0].logprobs.token_logprobs has {len(lp) if isinstance(lp, list) else 'no'} "
            f"values for {len(ids)} token ids"
        )
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in lp):
        raise ValueError("choices[0].logprobs.token_logprobs holds a non-number")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise ValueError(f"choices[0].finish_reason is {finish!r}, expected 'stop' or 'length'")
    return ids, [float(v) for v in lp], finish


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
        path, self._body, self._parse = PROTOCOLS[api]
        self.base_url = base_url.rstrip("/")
        self._url = self.base_url + path
        self.model = model
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
        check_sampling_params(params)
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; a prompt needs at least one token id")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_context:
            raise PromptTooLong(
                f"prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{need} > the engine's max_context {self.max_context}"
            )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.check(prompt_ids, params)
        payload = orjson.dumps(self._body(self.model, prompt_ids, params))  # ids: C speed
        version = self.model_version  # the version that served this request
        self.stats["requests"] += 1
        last = ""
        status = 502
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(min(self.backoff_max, self.backoff * 2 ** (attempt - 1)))
            self.stats["attempts"] += 1
            try:
                async with self._http().post(self._url, data=payload, headers=_JSON) as response:
                    code, raw = response.status, await response.read()
            except asyncio.TimeoutError as e:  # aiohttp's timeouts subclass it
                status, last = 504, f"timed out after {self.timeout:g} s ({type(e).__name__})"
                continue
            except aiohttp.ClientError as e:  # refused, reset, dropped mid-answer
                status, last = 503, f"{type(e).__name__}: {e}"
                continue
            if code == 200:
                try:
                    ids, logprobs, finish = self._parse(orjson.loads(raw))
                except ValueError as e:  # a malformed answer will not get better by asking again
                    self.stats["failures"] += 1
                    raise EngineError(
                        f"upstream {self.name!r} gave a bad answer: {e}", 502
                    ) from None
                return Generation(ids, logprobs, finish, version, extra={"attempts": attempt + 1})
            message = _error_message(code, raw)
            if code == 429 or code >= 500:
                status, last = (503 if code in (429, 503) else 502), f"HTTP {code}: {message}"
                continue
            if code == 400 and _TOO_LONG.search(message):
                raise PromptTooLong(f"upstream {self.name!r}: {message}")
            self.stats["failures"] += 1
            raise EngineError(
                f"upstream {self.name!r} refused the request: HTTP {code}: {message}", 502
            )
        self.stats["failures"] += 1
        raise EngineError(
            f"upstream {self.name!r} at {self.base_url} failed after {self.max_retries + 1} attempts: {last}",
            status,
        )

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
