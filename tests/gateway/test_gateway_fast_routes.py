"""The model routes are answered before FastAPI's middleware stack (fast_routes.py). The same requests get
the same answers (status, error body, response body, recorded turns) from that path and from the
FastAPI routes, which serve them when the app is served under a prefix (root_path)."""

from __future__ import annotations

import json
import socket

import httpx
from gateway_fixtures import FakeEngine

from tracetrain.engines.base import EngineError
from tracetrain.gateway import create_app, fast_routes
from tracetrain.gateway.serve import ThreadedServer
from tracetrain.store import SQLiteStore

ADMIN = "admin-key-for-hot-path-tests"
LIMIT = 16 * 1024
MSGS = [{"role": "user", "content": "Guess a number."}]


def comparable(response: httpx.Response):
    """Status and body, without what differs between two servers (creation time, random id)."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        chunks = [
            json.loads(line[6:])
            for line in response.text.split("\n\n")
            if line.startswith("data: {")
        ]
        assert len({c.pop("id") for c in chunks}) == 1  # one id for the whole stream
        for c in chunks:
            c.pop("created")
        return response.status_code, chunks, response.text.endswith("data: [DONE]\n\n")
    body = response.json()
    body.pop("created", None)
    body.pop("id", None)
    return response.status_code, body, response.headers.get("www-authenticate")


def scenario(base: str, engine: FakeEngine) -> list:
    """One fixed sequence of model calls, good and bad; returns what each got."""
    admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    made = admin.post("/rollouts", json={"rollouts": [{"rollout_id": "a"}, {"rollout_id": "b"}]})
    keys = {r["rollout_id"]: r["api_key"] for r in made.json()["rollouts"]}

    def call(rid, body, key="own", raw=None, suffix="chat/completions"):
        key = keys[rid] if key == "own" else key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        kw = {"content": raw, "headers": {**headers, "Content-Type": "application/json"}}
        if raw is None:
            kw = {"json": body, "headers": headers}
        return comparable(httpx.post(f"{base}/rollouts/{rid}/v1/{suffix}", timeout=30, **kw))

    out = [
        call("a", {"messages": MSGS, "return_token_ids": True}),
        call("a", {"messages": MSGS, "stream": True, "stream_options": {"include_usage": True}}),
        call("a", {"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1}, suffix="completions"),
        call("a", {"messages": MSGS}, key=None),
        call("a", {"messages": MSGS}, key="ttr-not-a-key"),
        call("a", {"messages": MSGS}, key=keys["b"]),
        call("nope", {"messages": MSGS}, key=ADMIN),
        call("a%0A", {"messages": MSGS}, key=ADMIN),
        call("a", None, raw=b'{"messages": ['),
        call("a", {"messages": "hi"}),
        call("a", {"messages": MSGS, "n": 2}),
        call("a", {"messages": [{"role": "user", "content": "word " * 2000}]}),
        call("a", None, raw=json.dumps({"messages": MSGS, "pad": "x" * LIMIT}).encode()),
    ]
    engine.fail_with = EngineError("upstream refused connection", 503)
    out.append(call("b", {"messages": MSGS}))
    engine.fail_with = None
    admin.patch("/rollouts/b", json={"state": "failed"})
    out.append(call("b", {"messages": MSGS}))
    out.append(admin.get("/rollouts/a/v1/chat/completions").status_code)
    turns = admin.get("/rollouts/a").json()["turns"]
    out.append([(t["prompt_ids"], t["response_ids"], t["response_logprobs"]) for t in turns])
    admin.close()
    return out


def serve_scenario(tmp_path, mounted: bool) -> tuple[list, int]:
    """(what the scenario got, how many calls fast_routes.serve answered)."""
    engine = FakeEngine(max_context=512)
    store = SQLiteStore(tmp_path / f"{mounted}.db")
    app = create_app(store, engine, admin_key=ADMIN, max_body_bytes=LIMIT)
    if mounted:  # behind a proxy that adds /gw: fast_routes.py does not match, FastAPI's routes answer
        app.root_path = "/gw"
    served = []
    real = fast_routes.serve

    async def counted(*args):
        served.append(1)
        return await real(*args)

    fast_routes.serve = counted
    try:
        with ThreadedServer(app) as server:
            return scenario(server.url + ("/gw" if mounted else ""), engine), len(served)
    finally:
        fast_routes.serve = real
        store.close()


def test_hot_path_and_fastapi_routes_answer_alike(tmp_path):
    fast, n_fast = serve_scenario(tmp_path, mounted=False)
    statuses = [g[0] if isinstance(g, tuple) else g for g in fast[:-1]]
    # ok x3, no key, unknown key, other's key, unknown rollout, bad id, malformed JSON, wrong
    # type, n=2, prompt over the context, body over the limit, engine down, ended; GET -> 405
    assert statuses == [200] * 3 + [401, 401, 403, 404, 422, 400, 422, 400, 400, 413, 503, 409, 405]
    assert len(fast[-1]) == 3  # three turns recorded, none for the refused calls
    routed, n_routed = serve_scenario(tmp_path, mounted=True)
    assert (n_fast, n_routed) == (15, 0)  # every POST to a model route took the path under test
    assert fast == routed


def test_declared_oversize_body_on_a_model_route_is_refused_unread(tmp_path):
    store = SQLiteStore(tmp_path / "g.db")
    app = create_app(store, FakeEngine(), admin_key=ADMIN, max_body_bytes=LIMIT)
    with ThreadedServer(app) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                b"POST /rollouts/a/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer " + ADMIN.encode() + b"\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n"
            )
            answer = b""
            while b"}}" not in answer and (chunk := s.recv(65536)):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 413") and str(LIMIT).encode() in answer

        def chunks():
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(4 * LIMIT // 1024):
                yield b"x" * 1024
            yield b'"}]}'

        r = httpx.post(
            server.url + "/rollouts/a/v1/chat/completions",
            content=chunks(),
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    store.close()
