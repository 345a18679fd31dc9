"""UpstreamEngine against the fake vLLM server on loopback: exact pass-through, retries, errors."""

from __future__ import annotations

import asyncio
import socket
import time

import openai
import orjson
import pytest
from aiohttp import web
from fake_upstream import FakeConfig, FakeUpstream, fake_generation

from tracetrain.engines.base import Engine, EngineError, PromptTooLong, SamplingParams
from tracetrain.engines.upstream import (
    UpstreamEngine,
    parse_choice,
    parse_chunk,
    parse_sglang,
    request_body,
)

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def fake():
    with FakeUpstream(response_len=8, max_model_len=MAX_MODEL_LEN) as f:
        yield f


@pytest.fixture
def clean(fake):
    """Fresh counters and no injected failures for each test."""
    fake.config.fail_first, fake.config.fail_status, fake.config.delay_s = 0, 500, 0.0
    fake.config.token_delay_s, fake.config.replies = 0.0, None
    for k in fake.stats:
        fake.stats[k] = 0
    return fake


def engine(url: str, **kw) -> UpstreamEngine:
    kw.setdefault("max_context", MAX_MODEL_LEN)
    kw.setdefault("backoff", 0.01)
    return UpstreamEngine(url, "fake", tokenizer=None, **kw)


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_ids_and_logprobs_pass_through_exactly(clean, api):
    eng = engine(clean.url, api=api)
    assert isinstance(eng, Engine)
    cases = [
        ([5, 6, 7], SamplingParams(max_tokens=20)),
        ([100] * 50, SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9)),  # cut by max_tokens
        ([9, 9], SamplingParams(max_tokens=20, seed=123)),
        ([9, 9], SamplingParams(max_tokens=20, seed=124)),
        ([1, 2, 3, 4], SamplingParams(max_tokens=20, stop_token_ids=tuple(range(3, 300)))),
    ]

    async def go():
        try:
            out = [await eng.generate(p, sp) for p, sp in cases]
            eng.model_version = 7
            out.append(await eng.generate([5, 6, 7], SamplingParams(max_tokens=20)))
            return out
        finally:
            await eng.aclose()

    gens = run(go())
    cfg = FakeConfig(response_len=8, max_model_len=MAX_MODEL_LEN)
    for (prompt, sp), gen in zip(
        cases + [([5, 6, 7], SamplingParams(max_tokens=20))], gens, strict=True
    ):
        ids, lps, finish = fake_generation(
            prompt, sp.max_tokens, seed=sp.seed, stop_token_ids=sp.stop_token_ids, config=cfg
        )
        assert gen.response_ids == ids
        assert gen.response_logprobs == lps  # bit-exact floats through JSON
        assert gen.finish_reason == finish
    assert [g.finish_reason for g in gens[:2]] == ["stop", "length"]
    assert gens[2].response_ids != gens[3].response_ids  # the seed reaches the server
    assert len(gens[4].response_ids) < 8  # so do stop ids: the first generated id is a stop
    assert [g.model_version for g in gens] == [0] * 5 + [7]
    assert clean.stats["completions" if api == "vllm" else "generate"] == 6


def test_stop_strings_end_the_answer_upstream(clean):
    """A stop string is sent as vLLM's `stop`; the answer ends with the token that completes it."""
    clean.config.replies = [[3, 4, 5, 6, 7, 8, 2]]  # the fake's letters: d e f g h i, then eos
    try:
        gen = run(engine(clean.url).generate([5, 6], SamplingParams(max_tokens=20, stop=("fg",))))
    finally:
        clean.config.replies = None
    assert (gen.response_ids, gen.finish_reason) == ([3, 4, 5, 6], "stop")


def test_request_body_is_vllm_shaped():
    body = request_body(
        "m", [1, 2], SamplingParams(max_tokens=5, temperature=0.5, seed=3, stop_token_ids=(9,))
    )
    assert body["prompt"] == [1, 2] and body["return_tokens_as_token_ids"] is True
    assert "return_token_ids" not in body and body["logprobs"] == 1
    assert (body["max_tokens"], body["temperature"], body["seed"], body["stop_token_ids"]) == (
        5,
        0.5,
        3,
        [9],
    )
    assert body["n"] == 1 and body["stream"] is False


@pytest.mark.parametrize(
    "fail_status,api", [(500, "vllm"), (503, "vllm"), (0, "vllm"), (500, "sglang"), (0, "sglang")]
)  # 0: the connection drops mid-answer
def test_retries_after_injected_failures(clean, fail_status, api):
    clean.config.fail_first, clean.config.fail_status = 2, fail_status
    eng = engine(clean.url, max_retries=3, api=api)

    async def go():
        try:
            return await eng.generate([5, 6, 7], SamplingParams(max_tokens=20))
        finally:
            await eng.aclose()

    gen = run(go())
    assert gen.response_ids == fake_generation([5, 6, 7], 20, config=clean.config)[0]
    assert gen.extra["attempts"] == 3
    assert clean.stats["requests"] == 3 and clean.stats["failed"] == 2
    assert eng.stats["retries"] == 2


@pytest.mark.parametrize("fail_status,status", [(500, 502), (503, 503), (429, 503), (0, 503)])
def test_gives_up_after_max_retries(clean, fail_status, status):
    clean.config.fail_first, clean.config.fail_status = 100, fail_status
    eng = engine(clean.url, max_retries=2)

    async def go():
        try:
            await eng.generate([5], SamplingParams(max_tokens=4))
        finally:
            await eng.aclose()

    with pytest.raises(EngineError, match="after 3 attempts") as e:
        run(go())
    assert e.value.status == status
    assert clean.stats["completions"] == 3


def test_unreachable_server_is_503_and_bounded():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    eng = engine(f"http://127.0.0.1:{port}", max_retries=2, backoff=0.01)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="ClientConnectorError|Connect") as e:
        run(eng.generate([5], SamplingParams(max_tokens=4)))
    assert e.value.status == 503
    assert time.monotonic() - t0 < 5.0
    assert eng.stats["attempts"] == 3


def test_timeouts_are_bounded_and_504(clean):
    clean.config.delay_s = 6.0
    eng = engine(clean.url, timeout=0.2, max_retries=1, backoff=0.01)
    t0 = time.monotonic()

    async def go():
        try:
            await eng.generate([5], SamplingParams(max_tokens=4))
        finally:
            await eng.aclose()

    with pytest.raises(EngineError, match="timed out") as e:
        run(go())
    elapsed = time.monotonic() - t0
    assert e.value.status == 504
    assert 0.4 <= elapsed < 4.0, elapsed  # 2 attempts x 0.2 s + backoff, not the 6 s delay


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_prompt_too_long_locally_and_from_upstream(clean, api):
    local = engine(clean.url)
    with pytest.raises(PromptTooLong, match="max_context 256"):
        run(local.generate([5] * 250, SamplingParams(max_tokens=10)))
    assert clean.stats["requests"] == 0  # refused before any call
    # an engine that believes in a larger context learns it from the server's 400, without retries
    optimist = engine(clean.url, max_context=10_000, max_retries=3, api=api)

    async def go():
        try:
            await optimist.generate([5] * 250, SamplingParams(max_tokens=10))
        finally:
            await optimist.aclose()

    with pytest.raises(PromptTooLong, match=r"context length \(256 tokens\)|context length is 256"):
        run(go())
    assert clean.stats["requests"] == 1


def test_other_client_errors_are_not_retried(clean):
    eng = engine(clean.url, max_retries=3)

    async def go():
        try:
            await eng.generate([100_000], SamplingParams(max_tokens=4))  # out of the fake's vocab
        finally:
            await eng.aclose()

    with pytest.raises(EngineError, match="out of vocabulary") as e:
        run(go())
    assert e.value.status == 502 and clean.stats["completions"] == 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=0),
        SamplingParams(temperature=-1.0),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.5),
        SamplingParams(stop_token_ids=(-3,)),
    ],
)
def test_bad_params_are_refused_before_any_call(clean, params):
    with pytest.raises(ValueError, match="max_tokens|temperature|top_p|stop_token_ids"):
        run(engine(clean.url).generate([5], params))
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        run(engine(clean.url).generate([], SamplingParams()))
    assert clean.stats["requests"] == 0


def named(ids: list[int]) -> list[str]:
    """Completions logprobs' tokens as vLLM names them with return_tokens_as_token_ids."""
    return [f"token_id:{i}" for i in ids]


@pytest.mark.parametrize(
    "payload,err",
    [
        ({}, "no choices"),
        (
            {"choices": [{"logprobs": {"token_logprobs": []}, "finish_reason": "stop"}]},
            "tokens is missing",
        ),
        (
            {
                "choices": [
                    {
                        "logprobs": {"tokens": named([1, 2]), "token_logprobs": [-1.0]},
                        "finish_reason": "stop",
                    }
                ]
            },
            "has 1 values for 2",
        ),
        (
            {"choices": [{"logprobs": {"tokens": named([1])}, "finish_reason": "stop"}]},
            "has no values",
        ),
        (  # a server that ignored return_tokens_as_token_ids: tokens as text
            {"choices": [{"logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0]}}]},
            "return_tokens_as_token_ids",
        ),
        (
            {
                "choices": [
                    {
                        "logprobs": {"tokens": named([1]), "token_logprobs": [None]},
                        "finish_reason": "stop",
                    }
                ]
            },
            "non-number",
        ),
        (
            {
                "choices": [
                    {
                        "logprobs": {"tokens": named([1]), "token_logprobs": [-1.0]},
                        "finish_reason": "abort",
                    }
                ]
            },
            "finish_reason",
        ),
        (
            {
                "choices": [
                    {
                        "logprobs": {"tokens": named([-1]), "token_logprobs": [-1.0]},
                        "finish_reason": "stop",
                    }
                ]
            },
            "token_id:N",
        ),
    ],
)
def test_malformed_answers_are_named(payload, err):
    with pytest.raises(ValueError, match=err):
        parse_choice(payload)


@pytest.mark.parametrize(
    "payload,err",
    [
        ({"text": "x"}, "no meta_info"),
        ({"meta_info": {"finish_reason": {"type": "stop"}}}, "output_token_logprobs is missing"),
        (
            {
                "meta_info": {
                    "output_token_logprobs": [[-1.0, "a"]],
                    "finish_reason": {"type": "stop"},
                }
            },
            "not a token id",
        ),
        (
            {
                "meta_info": {
                    "output_token_logprobs": [[None, 3]],
                    "finish_reason": {"type": "stop"},
                }
            },
            "not a number",
        ),
        (
            {
                "meta_info": {
                    "output_token_logprobs": [[-1.0, 3]],
                    "finish_reason": {"type": "abort"},
                }
            },
            "finish_reason",
        ),
    ],
)
def test_malformed_sglang_answers_are_named(payload, err):
    with pytest.raises(ValueError, match=err):
        parse_sglang(payload)
    ok = {
        "meta_info": {
            "output_token_logprobs": [[-0.5, 3, None], [-1, 2, "x"]],
            "finish_reason": {"type": "stop"},
        }
    }
    assert parse_sglang(ok) == ([3, 2], [-0.5, -1.0], "stop")


def test_concurrent_requests_share_the_pool(clean):
    eng = engine(clean.url, max_connections=8)
    prompts = [[3 + i, 7] for i in range(64)]

    async def go():
        try:
            return await asyncio.gather(
                *(eng.generate(p, SamplingParams(max_tokens=20)) for p in prompts)
            )
        finally:
            await eng.aclose()

    gens = run(go())
    for p, g in zip(prompts, gens, strict=True):
        assert g.response_ids == fake_generation(p, 20, config=clean.config)[0]
    assert clean.stats["completions"] == 64


def test_fake_speaks_the_openai_sdk_protocol(clean):
    """The fake is a stand-in for vLLM for the gateway and benchmarks: the real SDK parses it."""
    client = openai.OpenAI(base_url=clean.url + "/v1", api_key="x", max_retries=0)
    c = client.completions.create(
        model="fake",
        prompt=[5, 6, 7],
        max_tokens=20,
        logprobs=1,
        extra_body={"return_token_ids": True},
    )
    ids, lps, finish = fake_generation([5, 6, 7], 20, config=clean.config)
    assert c.choices[0].logprobs.token_logprobs == lps and c.choices[0].finish_reason == finish
    assert c.choices[0].model_extra["token_ids"] == ids and c.usage.completion_tokens == len(ids)
    chat = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    assert chat.choices[0].finish_reason == "length" and len(chat.choices[0].logprobs.content) == 5
    assert (
        len(chat.choices[0].model_extra["token_ids"]) == 5 and chat.model_extra["prompt_token_ids"]
    )
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    chunks = list(stream)
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chunks)
        == chat.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_upstream_engine_checks_its_arguments(clean):
    eng = UpstreamEngine(base_url=clean.url, model="fake", tokenizer=None, max_context=64)
    assert eng.max_context == 64
    with pytest.raises(ValueError, match="api 'tgi' is unknown; known: vllm, sglang"):
        UpstreamEngine(base_url=clean.url, model="m", tokenizer=None, max_context=8, api="tgi")
    with pytest.raises(ValueError, match="timeout must be a number > 0, got nan"):
        UpstreamEngine(
            base_url=clean.url,
            model="m",
            tokenizer=None,
            max_context=8,
            timeout=float("nan"),
        )
    with pytest.raises(ValueError, match="base_url"):
        UpstreamEngine(base_url="localhost:1", model="m", tokenizer=None, max_context=8)


# ----------------------------------------------------------------------------- streaming (vLLM SSE)
async def streamed(eng: UpstreamEngine, prompt: list[int], params: SamplingParams):
    """(Generation, the runs on_tokens got), the engine closed after."""
    runs: list[list[int]] = []
    try:
        return await eng.generate(prompt, params, runs.append), runs
    finally:
        await eng.aclose()


STREAM_CASES = [
    ([5, 6, 7], SamplingParams(max_tokens=20)),  # ends at eos
    ([100] * 50, SamplingParams(max_tokens=3, temperature=0.7)),  # cut by max_tokens
    ([9, 9], SamplingParams(max_tokens=20, seed=123)),
    ([1, 2, 3, 4], SamplingParams(max_tokens=20, stop_token_ids=tuple(range(3, 300)))),
]


@pytest.mark.parametrize("prompt,params", STREAM_CASES)
def test_streamed_runs_make_the_same_answer(clean, prompt, params):
    gen, runs = run(streamed(engine(clean.url), prompt, params))
    whole = run(engine(clean.url).generate(prompt, params))
    assert [t for r in runs for t in r] == gen.response_ids == whole.response_ids
    assert len(runs) == len(gen.response_ids)  # the fake sends one token per chunk
    assert gen.response_logprobs == whole.response_logprobs  # bit-exact through the chunks
    assert gen.finish_reason == whole.finish_reason
    assert (gen.response_ids, gen.response_logprobs, gen.finish_reason) == fake_generation(
        prompt,
        params.max_tokens,
        seed=params.seed,
        stop_token_ids=params.stop_token_ids,
        config=clean.config,
    )
    assert gen.extra["attempts"] == 1 and clean.stats["streams_cut"] == 0


def test_a_streamed_answer_ends_at_a_stop_string(clean):
    clean.config.replies = [[3, 4, 5, 6, 7, 8, 2]]  # the fake's letters: d e f g h i, then eos
    gen, runs = run(
        streamed(engine(clean.url), [5, 6], SamplingParams(max_tokens=20, stop=("fg",)))
    )
    assert runs == [[3], [4], [5], [6]] and (gen.response_ids, gen.finish_reason) == (
        [3, 4, 5, 6],
        "stop",
    )


async def first_run(eng: UpstreamEngine, prompt: list[int], params: SamplingParams):
    """Start a streamed generate and wait for its first run: (the task, the runs so far)."""
    runs: list[list[int]] = []
    first = asyncio.Event()

    def on_tokens(ids: list[int]) -> None:
        runs.append(ids)
        first.set()

    task = asyncio.create_task(eng.generate(prompt, params, on_tokens))
    await asyncio.wait_for(first.wait(), 30)
    return task, runs


def test_tokens_arrive_before_the_answer_ends(clean):
    """Woken by the first run, the test sees the answer unfinished and fewer runs than it will
    have: runs are handed over as the server sends them, not all at the end."""
    clean.config.token_delay_s = 0.05
    eng = engine(clean.url)

    async def go():
        try:
            task, runs = await first_run(eng, [5, 6, 7], SamplingParams(max_tokens=20))
            seen = (len(runs), task.done())
            return seen, await task, runs
        finally:
            await eng.aclose()

    (runs_seen, done_seen), gen, runs = run(go())
    assert not done_seen and runs_seen < len(runs) == len(gen.response_ids)


def test_cancelling_a_stream_closes_its_connection(clean):
    """vLLM aborts a request whose client goes away; the fake counts those streams."""
    clean.config.token_delay_s = 0.2
    eng = engine(clean.url)

    async def go():
        try:
            task, runs = await first_run(eng, [5, 6, 7], SamplingParams(max_tokens=20))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(500):  # the server learns of it asynchronously
                if clean.stats["streams_cut"]:
                    break
                await asyncio.sleep(0.01)
            return runs
        finally:
            await eng.aclose()

    runs = run(go())
    assert clean.stats["streams_cut"] == 1 and clean.stats["completions"] == 1
    assert 1 <= len(runs) < len(fake_generation([5, 6, 7], 20, config=clean.config)[0])


@pytest.mark.parametrize("fail_status", [500, 429, 0])  # 0: dropped before the first token
def test_a_stream_that_fails_before_its_first_token_is_retried(clean, fail_status):
    clean.config.fail_first, clean.config.fail_status = 2, fail_status
    gen, runs = run(
        streamed(engine(clean.url, max_retries=3), [5, 6, 7], SamplingParams(max_tokens=20))
    )
    assert [t for r in runs for t in r] == gen.response_ids
    assert gen.response_ids == fake_generation([5, 6, 7], 20, config=clean.config)[0]
    assert gen.extra["attempts"] == 3 and clean.stats["completions"] == 3


def test_a_stream_that_fails_after_a_token_is_not_retried(clean):
    clean.config.token_delay_s = 0.3  # 8 tokens: 2.4 s, past the engine's 1 s timeout
    eng = engine(clean.url, timeout=1.0, max_retries=3)
    runs: list[list[int]] = []

    async def go():
        try:
            await eng.generate([5, 6, 7], SamplingParams(max_tokens=20), runs.append)
        finally:
            await eng.aclose()

    with pytest.raises(EngineError, match=r"after streaming \d+ tokens \(not retried\)") as e:
        run(go())
    assert e.value.status == 504 and runs and clean.stats["completions"] == 1
    assert eng.stats == {"requests": 1, "attempts": 1, "retries": 0, "failures": 1}


def test_a_malformed_chunk_is_a_502_naming_the_field(clean):
    clean.config.replies = [[3, -1, 2]]  # the second chunk's token id is not one
    eng = engine(clean.url, max_retries=3)
    runs: list[list[int]] = []

    async def go():
        try:
            await eng.generate([5], SamplingParams(max_tokens=8), runs.append)
        finally:
            await eng.aclose()

    with pytest.raises(EngineError, match=r"bad answer: choices\[0\]\.logprobs\.tokens") as e:
        run(go())
    assert e.value.status == 502 and runs == [[3]] and clean.stats["completions"] == 1


def test_sglang_ignores_on_tokens(clean):
    runs: list[list[int]] = []
    gen = run(
        engine(clean.url, api="sglang").generate(
            [5, 6, 7], SamplingParams(max_tokens=20), runs.append
        )
    )
    assert runs == [] and gen.response_ids == fake_generation([5, 6, 7], 20, config=clean.config)[0]


def sse(*chunks) -> bytes:
    """A streamed answer: each chunk (a dict, or raw bytes) as an event, then [DONE]."""
    events = [c if isinstance(c, bytes) else b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks]
    return b"".join(events) + b"data: [DONE]\n\n"


def token_chunk(ids, finish=None, **extra) -> dict:
    choice = {
        "index": 0,
        "text": "",
        "finish_reason": finish,
        "logprobs": {"tokens": named(ids), "token_logprobs": [-0.25] * len(ids)},
        **extra,
    }
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


async def scripted(answers: list[bytes], prompt: list[int], **kw):
    """Stream from a server that answers request k with answers[k] (SSE bytes, 200): the
    (Generation or the exception raised, runs, requests seen)."""
    requests: list[web.Request] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        requests.append(request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(answers[min(len(requests), len(answers)) - 1])
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    eng = engine(f"http://{host}:{port}", **kw)
    runs: list[list[int]] = []
    try:
        out = await eng.generate(prompt, SamplingParams(max_tokens=8), runs.append)
    except EngineError as e:
        out = e
    finally:
        await eng.aclose()
        await runner.cleanup()
    return out, runs, len(requests)


def test_what_vllm_may_add_to_a_stream_is_read():
    """Keep-alive comments, a first chunk too long for a line reader (prompt_token_ids of a long
    prompt), chunks of several tokens, a last chunk without tokens and a usage chunk after it."""
    prompt = [12345] * 100_000  # 600 kB: past readline's limit (512 kB in aiohttp 3.14)
    answer = sse(
        b": keep-alive\n\n",
        token_chunk([3, 4], prompt_token_ids=prompt),
        token_chunk([5]),
        token_chunk([], "length"),
        {"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": {"total_tokens": 1}},
    )
    gen, runs, requests = run(scripted([answer], [1], max_retries=0))
    assert runs == [[3, 4], [5]] and gen.response_ids == [3, 4, 5]
    assert gen.response_logprobs == [-0.25] * 3 and gen.finish_reason == "length"


ERROR = {
    "error": {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def test_an_error_chunk_is_retried_only_before_the_first_token():
    ok = sse(token_chunk([3]), token_chunk([2], "stop"))
    gen, runs, requests = run(scripted([sse(ERROR), ok], [1], max_retries=2))
    assert (gen.response_ids, runs, requests, gen.extra["attempts"]) == ([3, 2], [[3], [2]], 2, 2)
    err, runs, requests = run(scripted([sse(token_chunk([3]), ERROR), ok], [1], max_retries=2))
    assert isinstance(err, EngineError) and err.status == 502 and (runs, requests) == ([[3]], 1)
    assert "after streaming 1 tokens" in str(err) and "Internal server error" in str(err)
    err, runs, requests = run(scripted([sse(token_chunk([3]))], [1], max_retries=2))
    assert isinstance(err, EngineError) and "without a choices[0].finish_reason" in str(err)


@pytest.mark.parametrize(
    "payload,err",
    [
        ({}, "no choices"),
        ({"choices": ["x"]}, "choices\\[0\\] is str"),
        ({"choices": [{"logprobs": {"tokens": named([1])}}]}, "has no values"),
        (
            {
                "choices": [
                    {
                        "logprobs": {"tokens": named([1]), "token_logprobs": [-1.0]},
                        "finish_reason": "abort",
                    }
                ]
            },
            "finish_reason",
        ),
    ],
)
def test_malformed_chunks_are_named(payload, err):
    with pytest.raises(ValueError, match=err):
        parse_chunk(payload)
    assert parse_chunk({"choices": [], "usage": {}}) == ([], [], None)
    assert parse_chunk(token_chunk([4, 5])) == ([4, 5], [-0.25, -0.25], None)


def test_scoring_on_a_server_without_prompt_logprobs_is_refused_naming_the_key(clean):
    """The fake answers a completion without prompt_logprobs (a server that ignores the key):
    an EngineError naming it, not retried; SGLang is not asked (ValueError naming it)."""
    from tracetrain.engines.score import score

    async def scored(eng):
        try:
            return await score(eng, [[5, 6, 7]], [[8, 9]])
        finally:
            await eng.aclose()

    with pytest.raises(EngineError, match="prompt_logprobs") as e:
        run(scored(engine(clean.url)))
    assert e.value.status == 502 and clean.stats["requests"] == 1
    with pytest.raises(ValueError, match="`prompt_logprobs`, which only a vLLM server"):
        run(scored(engine(clean.url, api="sglang")))
