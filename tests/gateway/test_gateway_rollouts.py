"""Rollout routes over HTTP: batch create (idempotent), get with turns, list by state with paging,
patch (legal transitions, reward override), delete; rewards and events; keys after an admin key
change; the serve command's arguments."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import httpx
import openai
import pytest
from gateway_fixtures import FakeEngine, gateway  # noqa: F401

from tracetrain.gateway import create_app
from tracetrain.gateway.serve import ThreadedServer, parse_args
from tracetrain.models.tiny import save_tiny
from tracetrain.store import SQLiteStore

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_create_defaults_and_idempotency(gateway):  # noqa: F811
    made = gateway.create(2)
    a, b = made
    assert a["rollout_id"] != b["rollout_id"] and a["group_id"] == a["rollout_id"]
    assert a["state"] == "queued" and a["created"] and a["n_turns"] == 0 and a["reward"] is None
    assert a["api_key"] != b["api_key"]
    spec = {
        "rollouts": [
            {"rollout_id": "x1", "group_id": "G", "task": {"n": [1, 2]}},
            {"rollout_id": a["rollout_id"]},
        ]
    }
    first = gateway.admin.post("/rollouts", json=spec).json()["rollouts"]
    assert [r["created"] for r in first] == [True, False]
    assert first[1]["api_key"] == a["api_key"]  # the existing rollout keeps its key
    assert first[0]["task"] == {"n": [1, 2]} and first[0]["group_id"] == "G"


def test_get_list_patch_delete(gateway):  # noqa: F811
    ids = [r["rollout_id"] for r in gateway.create(5, group_id="grp")]
    admin = gateway.admin
    for rid in ids[:3]:
        assert admin.patch(f"/rollouts/{rid}", json={"state": "running"}).status_code == 200
    pages, cursor = [], 0
    while True:
        page = admin.get(
            "/rollouts", params={"state": "running", "limit": 2, "cursor": cursor}
        ).json()
        pages.append([r["rollout_id"] for r in page["rollouts"]])
        if page["next_cursor"] is None:
            break
        cursor = page["next_cursor"]
    assert sum(pages, []) == ids[:3] and all(len(p) <= 2 for p in pages)
    assert [r["rollout_id"] for r in admin.get("/rollouts?state=queued").json()["rollouts"]] == ids[
        3:
    ]
    assert len(admin.get("/rollouts?group_id=grp").json()["rollouts"]) == 5

    # Legal transitions only; a terminal state is final.
    rid = ids[0]
    done = admin.patch(f"/rollouts/{rid}", json={"state": "succeeded"}).json()
    assert done["state"] == "succeeded"
    back = admin.patch(f"/rollouts/{rid}", json={"state": "running"})
    assert back.status_code == 409 and "succeeded" in back.json()["error"]["message"]
    skip = admin.patch(f"/rollouts/{ids[3]}", json={"state": "succeeded"})
    assert skip.status_code == 409  # queued -> succeeded skips running
    failed = admin.patch(f"/rollouts/{ids[4]}", json={"state": "timed_out", "error": "30 s"}).json()
    assert (failed["state"], failed["error"]) == ("timed_out", "30 s")

    # Reward: last reward event, unless overridden.
    admin.post(f"/rollouts/{rid}/rewards", json={"reward": 0.25, "info": {"found": False}})
    admin.post(f"/rollouts/{rid}/rewards", json={"reward": 0.5})
    assert admin.get(f"/rollouts/{rid}?turns=false").json()["reward"] == 0.5
    assert admin.patch(f"/rollouts/{rid}", json={"reward": 1.0}).json()["reward"] == 1.0
    assert admin.patch(f"/rollouts/{rid}", json={"reward": None}).json()["reward"] == 0.5
    events = admin.get(f"/rollouts/{rid}/events?kind=reward").json()["events"]
    assert [(e["reward"], e["payload"]) for e in events] == [(0.25, {"found": False}), (0.5, None)]

    # Delete: gone, its key too.
    (r,) = gateway.create()
    assert admin.delete(f"/rollouts/{r['rollout_id']}").status_code == 204
    assert admin.get(f"/rollouts/{r['rollout_id']}").status_code == 404
    assert admin.delete(f"/rollouts/{r['rollout_id']}").status_code == 404
    gone = httpx.post(
        r["base_url"] + "/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {r['api_key']}"},
        timeout=60,
    )
    assert gone.status_code == 401


def test_bulk_patch_applies_each_item_and_reports_the_ones_it_cannot(gateway):  # noqa: F811
    admin = gateway.admin
    ids = [r["rollout_id"] for r in gateway.create(4)]
    for rid in ids[:3]:
        admin.patch(f"/rollouts/{rid}", json={"state": "running"})
    body = {"rollouts": [
        {"rollout_id": ids[0], "state": "succeeded", "reward": 0.75},
        {"rollout_id": ids[1], "state": "failed", "error": "tool exploded"},
        {"rollout_id": "nobody", "state": "succeeded"},
        {"rollout_id": ids[3], "state": "succeeded"},  # queued -> succeeded skips running
        {"rollout_id": ids[2], "reward": 0.25},
    ]}
    out = admin.patch("/rollouts", json=body)
    assert out.status_code == 200, out.text
    res = out.json()["rollouts"]
    assert [r["status"] for r in res] == [200, 200, 404, 409, 200]
    assert "nobody" in res[2]["error"] and res[2]["rollout"] is None
    assert "queued" in res[3]["error"]
    stored = {rid: gateway.store.get_rollout(rid) for rid in ids}
    assert (stored[ids[0]].state.value, stored[ids[0]].reward) == ("succeeded", 0.75)
    assert (stored[ids[1]].state.value, stored[ids[1]].error) == ("failed", "tool exploded")
    assert stored[ids[2]].reward == 0.25 and stored[ids[2]].state.value == "running"
    assert stored[ids[3]].state.value == "queued"  # the refused item changed nothing
    assert res[0]["rollout"] == {**res[0]["rollout"], "state": "succeeded", "reward": 0.75}


@pytest.mark.parametrize("items,status,named", [
    ([{"rollout_id": "A", "state": "running"}, {"rollout_id": "A", "state": "failed"}], 400,
     "rollouts[1].rollout_id"),
    ([{"rollout_id": "A", "state": "running"}, {"rollout_id": "B"}], 400, "rollouts[1]."),
    ([{"rollout_id": "A", "error": "e"}], 400, "rollouts[0].error"),
    ([{"rollout_id": "A", "state": "done"}], 422, "rollouts.0.state"),
    ([{"rollout_id": "A", "state": "running", "colour": 1}], 422, "rollouts.0.colour"),
    ([], 422, "rollouts"),
])
def test_bulk_patch_refuses_a_malformed_item_whole(gateway, items, status, named):  # noqa: F811
    for rid in ("A", "B"):
        gateway.admin.post("/rollouts", json={"rollouts": [{"rollout_id": rid}]})
    r = gateway.admin.patch("/rollouts", json={"rollouts": items})
    assert r.status_code == status, r.text
    assert named in r.json()["error"]["message"] or named == r.json()["error"]["param"]
    assert {gateway.store.get_rollout(x).state.value for x in ("A", "B")} == {"queued"}


def test_agent_events_and_turns_in_detail(gateway):  # noqa: F811
    (r,) = gateway.create()
    auth = {"Authorization": f"Bearer {r['api_key']}"}
    base = gateway.url + f"/rollouts/{r['rollout_id']}"
    assert (
        httpx.post(base + "/v1/chat/completions", json=CHAT, headers=auth, timeout=60).status_code
        == 200
    )
    ev = httpx.post(
        base + "/events",
        json={"kind": "tool", "payload": {"name": "calc"}},
        headers=auth,
        timeout=60,
    )
    assert ev.status_code == 200 and ev.json()["kind"] == "tool"
    reserved = httpx.post(
        base + "/events", json={"kind": "reward", "payload": 1}, headers=auth, timeout=60
    )
    assert reserved.status_code == 400
    detail = gateway.admin.get(f"/rollouts/{r['rollout_id']}").json()
    (turn,) = detail["turns"]
    prompt, gen = gateway.engine.calls[0]
    assert turn["prompt_ids"] == prompt and turn["response_logprobs"] == gen.response_logprobs
    assert detail["state"] == "running"


def test_keys_after_admin_key_change(tmp_path):
    store = SQLiteStore(tmp_path / "k.db")
    old_key, new_key = "old-" + secrets.token_hex(8), "new-" + secrets.token_hex(8)
    with ThreadedServer(create_app(store, FakeEngine(), admin_key=old_key)) as server:
        made = httpx.post(
            server.url + "/rollouts",
            json={"rollouts": [{"rollout_id": "k1"}]},
            headers={"Authorization": f"Bearer {old_key}"},
            timeout=60,
        ).json()["rollouts"][0]
    with ThreadedServer(create_app(store, FakeEngine(), admin_key=new_key)) as server:
        url = server.url + "/rollouts/k1/v1/chat/completions"
        old_agent = {"Authorization": f"Bearer {made['api_key']}"}
        assert (
            httpx.post(url, json=CHAT, headers=old_agent, timeout=60).status_code == 200
        )  # still valid
        assert (
            httpx.get(
                server.url + "/rollouts", headers={"Authorization": f"Bearer {old_key}"}, timeout=60
            ).status_code
            == 401
        )
        again = httpx.post(
            server.url + "/rollouts",
            json={"rollouts": [{"rollout_id": "k1"}]},
            headers={"Authorization": f"Bearer {new_key}"},
            timeout=60,
        ).json()["rollouts"][0]
        assert not again["created"] and again["api_key"] != made["api_key"]  # re-issued
        assert httpx.post(url, json=CHAT, headers=old_agent, timeout=60).status_code == 401
        new_agent = {"Authorization": f"Bearer {again['api_key']}"}
        assert httpx.post(url, json=CHAT, headers=new_agent, timeout=60).status_code == 200
    store.close()


def test_serve_arguments_are_checked(monkeypatch, capsys):
    monkeypatch.delenv("TRACETRAIN_ADMIN_KEY", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--db", "x.db", "--engine", "local", "--model-path", "m"])
    assert "admin key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--db", "x.db", "--admin-key", "k", "--engine", "upstream", "--model", "m"])
    assert "--upstream-url" in capsys.readouterr().err
    monkeypatch.setenv("TRACETRAIN_ADMIN_KEY", "from-env")
    args = parse_args(["--db", "x.db", "--engine", "local", "--model-path", "m"])
    assert (args.admin_key, args.host, args.durability) == ("from-env", "127.0.0.1", "process")


@pytest.mark.slow
def test_serve_local_engine_end_to_end(tmp_path):
    """`python -m tracetrain.gateway.serve --engine local` on a saved tiny model, driven by the SDK."""
    model_dir = save_tiny(tmp_path / "tiny")
    key = "admin-" + secrets.token_hex(8)
    cmd = [
        sys.executable,
        "-m",
        "tracetrain.gateway.serve",
        "--db",
        str(tmp_path / "l.db"),
        "--port",
        "0",
        "--engine",
        "local",
        "--model-path",
        str(model_dir),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "TRACETRAIN_ADMIN_KEY": key}
    )
    try:
        url = proc.stdout.readline().strip().split("=", 1)[1]
        admin = {"Authorization": f"Bearer {key}"}
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        (r,) = httpx.post(
            url + "/rollouts", json={"rollouts": [{}]}, headers=admin, timeout=60
        ).json()["rollouts"]
        client = openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Guess a number."}],
            max_tokens=6,
            extra_body={"return_token_ids": True},
        )
        detail = httpx.get(f"{url}/rollouts/{r['rollout_id']}", headers=admin, timeout=60).json()
        (turn,) = detail["turns"]
        assert turn["response_ids"] == out.choices[0].model_extra["token_ids"]
        assert len(turn["response_logprobs"]) == len(turn["response_ids"]) <= 6
        assert all(lp <= 0 for lp in turn["response_logprobs"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
