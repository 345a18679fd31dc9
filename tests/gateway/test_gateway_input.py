"""Bad input gets a clear 4xx JSON error, leaves the store unchanged, and the server keeps serving;
only a failing engine gives 502/503/504, with its reason."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from fastapi.exceptions import RequestValidationError
from gateway_fixtures import FakeEngine, live_gateway
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.engines.base import EngineError
from tracetrain.gateway.schemas import ChatCompletionIn
from tracetrain.gateway.turn import parse_body, parse_json_body

LIMIT = 64 * 1024


def snapshot(store) -> list:
    """Everything the store holds, as comparable data."""
    out = []
    for r in store.list_rollouts(limit=10_000):
        turns = [(t.index, t.prompt_ids, t.response_ids) for t in store.get_turns(r.rollout_id)]
        events = [(e.kind, e.payload, e.reward) for e in store.list_events(r.rollout_id)]
        out.append((r.rollout_id, r.state, r.error, r.reward, r.n_turns, r.task, turns, events))
    return out


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    engine = FakeEngine(max_context=200)
    with live_gateway(tmp_path_factory.mktemp("input"), engine, max_body_bytes=LIMIT) as g:
        (r,) = g.create(rollout_id="r1", task={"q": "x"})
        g.rollout = r
        g.agent = httpx.Client(
            base_url=r["base_url"], headers={"Authorization": f"Bearer {r['api_key']}"}, timeout=30
        )
        ok = g.agent.post(
            "/chat/completions", json={"messages": [{"role": "user", "content": "a"}]}
        )
        assert ok.status_code == 200
        yield g
        g.agent.close()
        g.admin.close()


def msgs(text="hi"):
    return [{"role": "user", "content": text}]


# (description, client, method, path, raw body or json, expected status, words the message names)
CASES = [
    ("malformed json", "agent", "POST", "/chat/completions", b'{"messages": [', 400, ["JSON"]),
    ("not an object", "agent", "POST", "/chat/completions", b"[1, 2]", 422, ["object"]),
    (
        "messages not a list",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": "hi"},
        422,
        ["messages"],
    ),
    ("empty messages", "agent", "POST", "/chat/completions", {"messages": []}, 422, ["messages"]),
    (
        "bad role",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        422,
        ["messages.0", "role"],
    ),
    (
        "image part",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        422,
        ["messages.0.content"],
    ),
    (
        "temperature as string",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": msgs(), "temperature": "0.5"},
        422,
        ["temperature"],
    ),
    (
        "max_tokens zero",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": msgs(), "max_tokens": 0},
        422,
        ["max_tokens"],
    ),
    (
        "max_tokens bool",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": msgs(), "max_tokens": True},
        422,
        ["max_tokens"],
    ),
    ("n=2", "agent", "POST", "/chat/completions", {"messages": msgs(), "n": 2}, 400, ["n=1"]),
    (
        "penalty",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": msgs(), "presence_penalty": 0.5},
        400,
        ["presence_penalty"],
    ),
    (
        "five stops",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": msgs(), "stop": ["a", "b", "c", "d", "e"]},
        400,
        ["stop", "at most 4"],
    ),
    (
        "empty stop",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": msgs(), "stop": ["the end", ""]},
        400,
        ["stop[1]"],
    ),
    (
        "prompt over context",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": msgs("word " * 300)},
        400,
        ["context"],
    ),
    (
        "max_tokens over context",
        "agent",
        "POST",
        "/chat/completions",
        {"messages": msgs(), "max_tokens": 500},
        400,
        ["max_tokens", "context"],
    ),
    ("two prompts", "agent", "POST", "/completions", {"prompt": ["a", "b"]}, 400, ["prompt"]),
    (
        "token id out of vocab",
        "agent",
        "POST",
        "/completions",
        {"prompt": [1, 10**6]},
        400,
        ["vocabulary"],
    ),
    ("echo", "agent", "POST", "/completions", {"prompt": "a", "echo": True}, 400, ["echo"]),
    ("deep nesting", "agent", "POST", "/chat/completions", b"[" * 20_000, 400, ["body"]),
    ("reward as string", "agent", "POST", "/../rewards", {"reward": "1"}, 422, ["reward"]),
    ("reward NaN", "agent", "POST", "/../rewards", b'{"reward": NaN}', 422, ["reward"]),
    (
        "task NaN",
        "admin",
        "POST",
        "/rollouts",
        b'{"rollouts": [{"task": [1, NaN]}]}',
        422,
        ["task"],
    ),
    ("unknown field", "admin", "POST", "/rollouts", {"rollouts": [{"nope": 1}]}, 422, ["nope"]),
    (
        "bad id",
        "admin",
        "POST",
        "/rollouts",
        {"rollouts": [{"rollout_id": "a/b"}]},
        422,
        ["rollout_id"],
    ),
    (
        "duplicate ids",
        "admin",
        "POST",
        "/rollouts",
        {"rollouts": [{"rollout_id": "d"}, {"rollout_id": "d"}]},
        400,
        ["twice"],
    ),
    (
        "unknown engine",
        "admin",
        "POST",
        "/rollouts",
        {"rollouts": [{"engine": "gpt9"}]},
        400,
        ["gpt9"],
    ),
    (
        "conflicting re-create",
        "admin",
        "POST",
        "/rollouts",
        {"rollouts": [{"rollout_id": "r1", "task": {"q": "other"}}]},
        409,
        ["r1"],
    ),
    ("unknown rollout", "admin", "GET", "/rollouts/nope", None, 404, ["nope"]),
    (
        "id with a newline",
        "admin",
        "POST",
        "/rollouts/r1%0A/v1/chat/completions",
        {"messages": msgs()},
        422,
        ["rollout_id"],
    ),
    (
        "unknown rollout chat",
        "admin",
        "POST",
        "/rollouts/nope/v1/chat/completions",
        {"messages": msgs()},
        404,
        ["nope"],
    ),
    (
        "illegal transition",
        "admin",
        "PATCH",
        "/rollouts/r1",
        {"state": "queued"},
        409,
        ["running", "queued"],
    ),
    ("unknown state", "admin", "PATCH", "/rollouts/r1", {"state": "done"}, 422, ["state"]),
    ("empty patch", "admin", "PATCH", "/rollouts/r1", {}, 400, ["nothing"]),
    ("bad paging", "admin", "GET", "/rollouts?limit=0", None, 422, ["limit"]),
    ("bad state filter", "admin", "GET", "/rollouts?state=done", None, 422, ["state"]),
    ("unknown route", "admin", "GET", "/nope", None, 404, []),
    ("wrong method", "admin", "PUT", "/rollouts", None, 405, []),
    ("unknown engine pause", "admin", "POST", "/engines/gpt9/pause", None, 404, ["gpt9"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(gw, case):
    _, who, method, path, body, status, words = case
    client = gw.agent if who == "agent" else gw.admin
    if path.startswith("/.."):
        path = gw.url + f"/rollouts/{gw.rollout['rollout_id']}" + path[3:]
    before = snapshot(gw.store)
    kw = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = client.request(method, path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status
    for word in words:
        assert word in err["message"], (word, err["message"])
    assert snapshot(gw.store) == before
    # still serving
    assert (
        gw.agent.post("/chat/completions", json={"messages": msgs(), "max_tokens": 3}).status_code
        == 200
    )


def test_oversize_body_declared_is_refused_unread(gw):
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        # Declares a terabyte and sends none of it: the answer must come without reading it.
        s.sendall(
            b"POST /rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + gw.admin_key.encode() + b"\r\n"
            b"Content-Length: 1000000000000\r\n\r\n"
        )
        answer = b""
        while b"}}" not in answer and (chunk := s.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert str(LIMIT).encode() in answer


def test_oversize_body_chunked_is_cut_off(gw):
    before = snapshot(gw.store)

    def chunks():
        yield b'{"rollouts": [{"task": "'
        for _ in range(4 * LIMIT // 1024):
            yield b"x" * 1024
        yield b'"}]}'

    r = gw.admin.post("/rollouts", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert snapshot(gw.store) == before
    # A body just under the limit is fine.
    ok = gw.admin.post("/rollouts", json={"rollouts": [{"task": "y" * (LIMIT - 100)}]})
    assert ok.status_code == 200


def test_requests_after_the_end_are_409(tmp_path):
    with live_gateway(tmp_path) as g:
        (r,) = g.create()
        agent = httpx.Client(
            base_url=r["base_url"], headers={"Authorization": f"Bearer {r['api_key']}"}, timeout=60
        )
        assert (
            g.admin.patch(
                f"/rollouts/{r['rollout_id']}", json={"state": "failed", "error": "boom"}
            ).status_code
            == 200
        )
        before = snapshot(g.store)
        chat = agent.post("/chat/completions", json={"messages": msgs()})
        assert chat.status_code == 409 and "failed" in chat.json()["error"]["message"]
        # The agent's reward after the end is refused; the trainer's is taken.
        rurl = g.url + f"/rollouts/{r['rollout_id']}/rewards"
        late = httpx.post(
            rurl,
            json={"reward": 1.0},
            headers={"Authorization": f"Bearer {r['api_key']}"},
            timeout=60,
        )
        assert late.status_code == 409
        assert snapshot(g.store) == before
        assert g.engine.calls == []  # the engine was never asked
        assert g.admin.post(rurl, json={"reward": 1.0}).status_code == 200
        detail = g.admin.get(f"/rollouts/{r['rollout_id']}").json()
        assert (detail["state"], detail["error"], detail["reward"]) == ("failed", "boom", 1.0)
        agent.close()
        g.admin.close()


@pytest.mark.parametrize(
    ("failure", "status", "words"),
    [
        (EngineError("upstream refused connection", 503), 503, ["refused connection"]),
        (EngineError("upstream timed out after 5 s", 504), 504, ["timed out"]),
        (RuntimeError("CUDA out of memory"), 502, ["RuntimeError", "out of memory"]),
    ],
)
def test_engine_failures_are_5xx_with_reason_and_record_nothing(tmp_path, failure, status, words):
    engine = FakeEngine()
    engine.fail_with = failure
    with live_gateway(tmp_path, engine) as g:
        (r,) = g.create()
        agent = httpx.Client(
            base_url=r["base_url"], headers={"Authorization": f"Bearer {r['api_key']}"}, timeout=60
        )
        resp = agent.post("/chat/completions", json={"messages": msgs()})
        assert resp.status_code == status
        for word in words:
            assert word in resp.json()["error"]["message"]
        assert g.store.get_turns(r["rollout_id"]) == []
        engine.fail_with = None
        assert agent.post("/chat/completions", json={"messages": msgs()}).status_code == 200
        agent.close()
        g.admin.close()


def test_invalid_generation_is_502(tmp_path):
    class Broken(FakeEngine):
        async def generate(self, prompt_ids, params):
            gen = await super().generate(prompt_ids, params)
            return type(gen)(gen.response_ids, gen.response_logprobs[:-1], "stop", 0)

    with live_gateway(tmp_path, Broken()) as g:
        (r,) = g.create()
        resp = httpx.post(
            r["base_url"] + "/chat/completions",
            json={"messages": msgs()},
            headers={"Authorization": f"Bearer {r['api_key']}"},
            timeout=60,
        )
        assert resp.status_code == 502 and "response_logprobs" in resp.json()["error"]["message"]
        assert g.store.get_turns(r["rollout_id"]) == []
        g.admin.close()


# A chat body is parsed once (orjson, then pydantic on the values); what it accepts and the
# errors it gives must be those of pydantic's own JSON parse, which the rest of this file checks.
_json_leaf = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=5) | st.sampled_from(["user", "assistant", "tool", "system", "text", "auto"])
)
_json_value = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "name", "x"]), inner,
                      max_size=3),
    max_leaves=8,
)
_chat_field = st.sampled_from(
    ["messages", "model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "tools",
     "tool_choice", "logprobs", "top_logprobs", "n", "extra_field"]
)


@settings(max_examples=300, deadline=None)
@given(
    body=st.dictionaries(_chat_field, _json_value, max_size=5)
    | st.fixed_dictionaries({"messages": st.lists(_json_value, min_size=1, max_size=3)})
    | _json_value
)
def test_one_parse_of_a_chat_body_accepts_and_refuses_as_pydantic_parsing_the_json(body):
    raw = json.dumps(body).encode()
    try:
        want = parse_body(ChatCompletionIn, raw)
    except RequestValidationError as e:
        with pytest.raises(RequestValidationError) as got:
            parse_json_body(ChatCompletionIn, raw)
        assert got.value.errors() == e.errors()
        return
    got, data = parse_json_body(ChatCompletionIn, raw)
    assert got == want and data == json.loads(raw)


BIG = 2**64  # one past orjson's integer range: orjson.loads read it as a float, rounded


@pytest.mark.parametrize("big", [BIG, -(2**63) - 1, 2**70 + 1, 10**40 + 7])
def test_a_chat_body_reads_integers_beyond_64_bits_exactly(big):
    raw = (f'{{"messages": [{{"role": "user", "content": "hi", "x": [{big}, 1.5]}}], '
           f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": '
           f'{{"maximum": {big}}}}}}}], "extra_field": {big}}}').encode()
    body, data = parse_json_body(ChatCompletionIn, raw)
    assert data == json.loads(raw) and body == parse_body(ChatCompletionIn, raw)
    assert data["messages"][0]["x"][0] == big and type(data["messages"][0]["x"][0]) is int
    assert body.tools[0]["function"]["parameters"]["maximum"] == big


def test_a_big_integer_reaches_the_prompt_and_the_store_with_its_digits(tmp_path):
    with live_gateway(tmp_path) as g:
        (r,) = g.create(1)
        big = 2**70 + 1
        raw = (f'{{"model": "p", "max_tokens": 4, "messages": [{{"role": "user", "content": "hi", '
               f'"x": {big}}}], "tools": [{{"type": "function", "function": {{"name": "f", '
               f'"parameters": {{"type": "object", "properties": {{"n": {{"type": "integer", '
               f'"maximum": {big}}}}}}}}}}}]}}')
        got = httpx.post(r["base_url"] + "/chat/completions", content=raw, timeout=30,
                         headers={"Authorization": f"Bearer {r['api_key']}",
                                  "Content-Type": "application/json"})
        assert got.status_code == 200, got.text
        (turn,) = g.store.get_turns(r["rollout_id"])
        assert json.loads(turn.messages) == [{"role": "user", "content": "hi", "x": big}]
        assert str(big) in g.engine.tokenizer.decode(turn.prompt_ids)  # the tool schema, exact
        g.admin.close()
