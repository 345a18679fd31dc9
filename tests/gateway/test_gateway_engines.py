"""Engine routes: pause (bounded wait, then 503), resume, drain (waits for in-flight requests),
registration of a real UpstreamEngine (persisted and rebuilt after a restart), model versions."""

from __future__ import annotations

import secrets
import threading
import time

import httpx
import pytest
from fake_upstream import FakeConfig, FakeUpstream, fake_generation
from gateway_fixtures import FakeEngine, live_gateway, tiny_tokenizer

from tracetrain.gateway import create_app
from tracetrain.gateway.serve import ThreadedServer, upstream_factory
from tracetrain.store import SQLiteStore

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def agent(r: dict) -> httpx.Client:
    return httpx.Client(
        base_url=r["base_url"], headers={"Authorization": f"Bearer {r['api_key']}"}, timeout=30
    )


def in_thread(fn):
    """Run fn() in a thread; returns (thread, result box)."""
    box: dict = {}

    def run():
        t0 = time.monotonic()
        box["result"] = fn()
        box["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_pause_holds_requests_until_resume(tmp_path):
    with live_gateway(tmp_path, pause_wait_s=30) as gw:
        (r,) = gw.create()
        a = agent(r)
        assert gw.admin.post("/engines/default/pause").json()["paused"] is True
        t, box = in_thread(lambda: a.post("/chat/completions", json=CHAT))
        time.sleep(0.4)
        assert "result" not in box and gw.engine.calls == []  # waiting at the gate
        assert gw.store.get_rollout(r["rollout_id"]).state == "queued"
        assert gw.admin.post("/engines/default/resume").json()["paused"] is False
        t.join(10)
        assert box["result"].status_code == 200 and box["elapsed"] >= 0.4
        assert len(gw.store.get_turns(r["rollout_id"])) == 1
        a.close()
        gw.admin.close()


def test_pause_is_bounded_then_503(tmp_path):
    with live_gateway(tmp_path, pause_wait_s=0.3) as gw:
        (r,) = gw.create()
        a = agent(r)
        gw.admin.post("/engines/default/pause")
        t0 = time.monotonic()
        resp = a.post("/chat/completions", json=CHAT)
        assert resp.status_code == 503 and "paused" in resp.json()["error"]["message"]
        assert 0.3 <= time.monotonic() - t0 < 5
        assert gw.store.get_turns(r["rollout_id"]) == [] and gw.engine.calls == []
        gw.admin.post("/engines/default/resume")
        assert a.post("/chat/completions", json=CHAT).status_code == 200
        a.close()
        gw.admin.close()


def test_drain_waits_for_in_flight_requests(tmp_path):
    engine = FakeEngine(delay=2.0)  # long enough for the checks below on a loaded machine
    with live_gateway(tmp_path, engine, pause_wait_s=30) as gw:
        rs = gw.create(3)
        clients = [agent(r) for r in rs]
        slow = [in_thread(lambda c=c: c.post("/chat/completions", json=CHAT)) for c in clients[:2]]
        deadline = time.monotonic() + 10
        while gw.admin.get("/engines").json()["engines"][0]["in_flight"] < 2:  # both generating
            assert time.monotonic() < deadline, "the two requests were not admitted within 10 s"
            time.sleep(0.02)
        # A drain that gives up early says so.
        early = gw.admin.post("/engines/default/drain?timeout_s=0.05").json()
        assert early == {"drained": False, "in_flight": 2}
        t0 = time.monotonic()
        done = gw.admin.post("/engines/default/drain?timeout_s=10").json()
        assert done == {"drained": True, "in_flight": 0}
        for t, box in slow:  # drain returned only after the in-flight requests had answered
            t.join(10)
            assert box["result"].status_code == 200
        assert time.monotonic() - t0 > 0.1
        # Drained means paused: a new request waits until resume.
        t, box = in_thread(lambda: clients[2].post("/chat/completions", json=CHAT))
        time.sleep(0.3)
        assert "result" not in box
        gw.engine.model_version = 7  # the weight update
        gw.admin.post("/engines/default/resume")
        t.join(10)
        assert box["result"].json()["tracetrain"]["model_version"] == 7
        assert [t.model_version for t in gw.store.get_turns(rs[2]["rollout_id"])] == [7]
        assert [t.model_version for t in gw.store.get_turns(rs[0]["rollout_id"])] == [0]
        for c in clients:
            c.close()
        gw.admin.close()


def test_register_upstream_is_used_persisted_and_rebuilt(tmp_path):
    key = "admin-" + secrets.token_hex(16)
    spec = {"name": "vllm-2", "base_url": None, "model": "fake", "max_context": 512}
    with FakeUpstream() as fake:
        spec["base_url"] = fake.url
        store = SQLiteStore(tmp_path / "g.db")
        app = create_app(store, FakeEngine(), admin_key=key, engine_factory=upstream_factory)
        with (
            ThreadedServer(app) as server,
            httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
            ) as admin,
        ):
            out = admin.post("/engines", json=spec)
            assert out.status_code == 200 and out.json()["max_context"] == 512
            assert admin.post("/engines", json=spec).status_code == 409
            bad = admin.post(
                "/engines", json={**spec, "name": "x", "tokenizer": str(tmp_path / "none")}
            )
            assert bad.status_code == 400 and "none" in bad.json()["error"]["message"]
            (r,) = admin.post("/rollouts", json={"rollouts": [{"engine": "vllm-2"}]}).json()[
                "rollouts"
            ]
            with agent(r) as a:
                resp = a.post("/chat/completions", json=CHAT)
            assert resp.status_code == 200
            (turn,) = store.get_turns(r["rollout_id"])
            ids, _, finish = fake_generation(turn.prompt_ids, 8, config=FakeConfig())
            assert (
                turn.response_ids == ids and turn.finish_reason == finish
            )  # the upstream's answer
            assert fake.stats["completions"] == 1
        assert store.list_engines()["vllm-2"]["base_url"] == fake.url
        # A new gateway on the same store rebuilds the registered engine at startup.
        app2 = create_app(store, FakeEngine(), admin_key=key, engine_factory=upstream_factory)
        with (
            ThreadedServer(app2) as server,
            httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
            ) as admin,
        ):
            names = [e["name"] for e in admin.get("/engines").json()["engines"]]
            assert names == ["default", "vllm-2"]
            url = f"/rollouts/{r['rollout_id']}/v1/chat/completions"
            assert admin.post(url, json=CHAT).status_code == 200
            assert fake.stats["completions"] == 2
        store.close()


def test_registration_needs_a_factory(tmp_path):
    with live_gateway(tmp_path) as gw:
        resp = gw.admin.post(
            "/engines", json={"name": "x", "base_url": "http://127.0.0.1:1", "model": "m"}
        )
        assert resp.status_code == 400 and "factory" in resp.json()["error"]["message"]
        gw.admin.close()


def test_create_app_checks_its_arguments(tmp_path):
    store = SQLiteStore(tmp_path / "a.db")
    engine = FakeEngine(tiny_tokenizer())
    with pytest.raises(ValueError, match="admin_key"):
        create_app(store, engine, admin_key="")
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(store, engine, admin_key="k" * 16, max_body_bytes=0)
    with pytest.raises(ValueError, match="default_engine"):
        create_app(store, {"a": engine}, admin_key="k" * 16, default_engine="b")
    with pytest.raises(TypeError, match="generate"):
        create_app(store, {"a": object()}, admin_key="k" * 16)
    store.close()
