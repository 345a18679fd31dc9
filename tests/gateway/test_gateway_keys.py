"""Scoped keys: every route x {no key, another rollout's key, own key, admin key} -> status.
Keys are never stored, never echoed, never logged."""

from __future__ import annotations

import itertools
import secrets

import httpx
import pytest
from gateway_fixtures import FakeEngine

from tracetrain.gateway import create_app
from tracetrain.gateway.serve import ThreadedServer
from tracetrain.store import SQLiteStore

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
_names = itertools.count()

# (method, path, json body) -> expected status for (none, other, own, admin).
# {A} is the rollout the own key belongs to; {E} an engine that serves no rollout.
TABLE = [
    ("POST", "/rollouts", {"rollouts": [{}]}, (401, 403, 403, 200)),
    ("GET", "/rollouts", None, (401, 403, 403, 200)),
    ("GET", "/rollouts/{A}", None, (401, 403, 403, 200)),
    ("PATCH", "/rollouts/{A}", {"state": "running"}, (401, 403, 403, 200)),
    ("DELETE", "/rollouts/{A}", None, (401, 403, 403, 204)),
    ("GET", "/rollouts/{A}/events", None, (401, 403, 403, 200)),
    ("POST", "/rollouts/{A}/rewards", {"reward": 1.0}, (401, 403, 200, 200)),
    ("POST", "/rollouts/{A}/events", {"kind": "log", "payload": {"x": 1}}, (401, 403, 200, 200)),
    ("POST", "/rollouts/{A}/v1/chat/completions", CHAT, (401, 403, 200, 200)),
    (
        "POST",
        "/rollouts/{A}/v1/completions",
        {"prompt": "hi", "max_tokens": 4},
        (401, 403, 200, 200),
    ),
    ("GET", "/rollouts/{A}/v1/models", None, (401, 403, 200, 200)),
    ("GET", "/rollouts/ghost/v1/models", None, (401, 403, 403, 404)),
    ("GET", "/engines", None, (401, 403, 403, 200)),
    ("POST", "/engines", "register", (401, 403, 403, 200)),
    ("POST", "/engines/{E}/pause", None, (401, 403, 403, 200)),
    ("POST", "/engines/{E}/resume", None, (401, 403, 403, 200)),
    ("POST", "/engines/{E}/drain?timeout_s=1", None, (401, 403, 403, 200)),
]
WHO = ("none", "other", "own", "admin")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.db"
    store = SQLiteStore(path)
    key = "admin-" + secrets.token_hex(16)
    engines = {"default": FakeEngine(record=False), "spare": FakeEngine(record=False)}
    app = create_app(store, engines, admin_key=key, engine_factory=lambda spec, gw: FakeEngine())
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        yield http, key, path
    store.close()


def _headers(key: str | None) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("method", "path", "body", "expected"), TABLE, ids=[f"{m} {p}" for m, p, *_ in TABLE]
)
def test_route_access(live, method, path, body, expected):
    http, admin_key, _ = live
    made = http.post("/rollouts", json={"rollouts": [{}, {}]}, headers=_headers(admin_key)).json()
    own, other = made["rollouts"]
    keys = {"none": None, "other": other["api_key"], "own": own["api_key"], "admin": admin_key}
    url = path.format(A=own["rollout_id"], E="spare")
    for who, status in zip(WHO, expected, strict=True):
        if body == "register":
            payload = {"name": f"up{next(_names)}", "base_url": "http://127.0.0.1:9", "model": "m"}
        else:
            payload = body
        r = http.request(method, url, json=payload, headers=_headers(keys[who]))
        assert r.status_code == status, (who, r.text)
        if status >= 400:
            err = r.json()["error"]
            assert err["code"] == status and err["message"]
            assert own["api_key"] not in r.text and admin_key not in r.text


def test_bad_keys_are_401_and_not_echoed(live):
    http, admin_key, _ = live
    (r,) = http.post("/rollouts", json={"rollouts": [{}]}, headers=_headers(admin_key)).json()[
        "rollouts"
    ]
    url = f"/rollouts/{r['rollout_id']}/v1/chat/completions"
    forged = r["api_key"][:-4] + "AAAA"
    for headers in (
        {"Authorization": f"Bearer {forged}"},
        {"Authorization": f"Bearer {admin_key}x"},
        {"Authorization": f"Basic {r['api_key']}"},
        {"Authorization": r["api_key"]},
    ):
        resp = http.post(url, json=CHAT, headers=headers)
        assert resp.status_code == 401, headers
        assert r["api_key"] not in resp.text and forged not in resp.text


def test_keys_are_not_stored_and_idempotent_create_returns_the_same_key(live):
    http, admin_key, path = live
    spec = {"rollouts": [{"rollout_id": "same-id", "task": {"q": 1}}]}
    first = http.post("/rollouts", json=spec, headers=_headers(admin_key)).json()["rollouts"][0]
    again = http.post("/rollouts", json=spec, headers=_headers(admin_key)).json()["rollouts"][0]
    assert first["created"] and not again["created"]
    assert first["api_key"] == again["api_key"]
    assert first["base_url"].endswith("/rollouts/same-id/v1")
    raw = b"".join(p.read_bytes() for p in path.parent.iterdir() if p.name.startswith(path.name))
    assert first["api_key"].encode() not in raw and admin_key.encode() not in raw
    assert b"same-id" in raw  # the scan does see what is stored


def test_access_log_has_no_keys(tmp_path, capfd):
    store = SQLiteStore(tmp_path / "log.db")
    key = "admin-" + secrets.token_hex(16)
    app = create_app(store, FakeEngine(record=False), admin_key=key)
    with ThreadedServer(app, access_log=True, log_level="info") as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            made = http.post("/rollouts", json={"rollouts": [{}]}, headers=_headers(key))
            (r,) = made.json()["rollouts"]
            url = f"/rollouts/{r['rollout_id']}"
            http.post(url + "/v1/chat/completions", json=CHAT, headers=_headers(r["api_key"]))
            http.post(url + "/rewards", json={"reward": 1}, headers=_headers(r["api_key"] + "x"))
    store.close()
    out = "\n".join(capfd.readouterr())
    assert f'"POST {url}/v1/chat/completions HTTP/1.1" 200' in out  # the access log is on
    assert f'"POST {url}/rewards HTTP/1.1" 401' in out
    assert key not in out and r["api_key"] not in out
