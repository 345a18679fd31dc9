"""Roles and turn rewards at the gateway: each call records the role that made it (the request's
`model`, or a role's base URL), rewards are given to turns while the rollout runs, bad input is
refused with a 4xx in the API's shape naming the field, recording nothing, and roles that share an
engine each continue their own turns exactly (context: exact)."""

from __future__ import annotations

from itertools import pairwise
from urllib.parse import quote

import anthropic
import httpx
import openai
import pytest
from gateway_fixtures import FakeEngine, ScriptedEngine, gateway, live_gateway  # noqa: F401

from tracetrain.gateway.app import create_app
from tracetrain.gateway.context import KEEP
from tracetrain.gateway.serve import ThreadedServer
from tracetrain.rows.aggregate import aggregate

CHAT = [{"role": "user", "content": "hi"}]


def turns_of(gw, rid: str) -> list[dict]:
    return gw.admin.get(f"/rollouts/{rid}", params={"turns": "true"}).json()["turns"]


def root(r: dict) -> str:
    return r["base_url"].removesuffix("/v1")


def test_each_api_records_the_role_its_request_names(gateway):  # noqa: F811
    (r,) = gateway.create(1)
    rid, key = r["rollout_id"], r["api_key"]
    oa = openai.OpenAI(base_url=r["base_url"], api_key=key)
    oa.chat.completions.create(model="solver", messages=CHAT, max_tokens=4)
    oa.completions.create(model="checker", prompt="hi", max_tokens=4)
    oa.responses.create(model="planner", input="hi", max_output_tokens=4)
    an = anthropic.Anthropic(base_url=root(r), api_key=key)
    an.messages.create(model="claude-3-5-haiku-latest", max_tokens=4, messages=CHAT)
    # A harness whose model name is fixed names the role in its base URL instead.
    fixed = openai.OpenAI(base_url=f"{root(r)}/roles/summariser/v1", api_key=key)
    fixed.chat.completions.create(model="gpt-4o-mini", messages=CHAT, max_tokens=4)
    assert fixed.models.list().data[0].id == "default"  # the role's engine: the rollout's
    # No model at all (the raw HTTP API allows it): the default role.
    httpx.post(f"{r['base_url']}/chat/completions", json={"messages": CHAT, "max_tokens": 4},
               headers={"Authorization": f"Bearer {key}"}).raise_for_status()
    roles = [t["role"] for t in turns_of(gateway, rid)]
    assert roles == ["solver", "checker", "planner", "claude-3-5-haiku-latest", "summariser",
                     "policy"]
    assert [t.role for t in gateway.store.get_turns(rid)] == roles


@pytest.mark.parametrize("where", ["model", "path"])
@pytest.mark.parametrize("bad", ["two words", "<script>", "a" * 101, "-lead", "x\ny"])
def test_a_role_that_is_not_a_role_name_is_refused_naming_the_field(gateway, where, bad):  # noqa: F811
    (r,) = gateway.create(1)
    key = r["api_key"]
    if where == "model":
        url, body = f"{r['base_url']}/chat/completions", {"model": bad, "messages": CHAT}
    else:
        url = f"{root(r)}/roles/{quote(bad, safe='')}/v1/chat/completions"
        body = {"model": "fine", "messages": CHAT}
    resp = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 422, resp.text
    err = resp.json()["error"]
    assert err["param"] == ("model" if where == "model" else "role")
    assert "not a role name" in err["message"]
    assert gateway.store.get_turns(r["rollout_id"]) == []  # nothing recorded
    assert gateway.engine.calls == []  # and nothing generated


def test_anthropic_errors_keep_anthropics_shape_for_a_bad_role(gateway):  # noqa: F811
    (r,) = gateway.create(1)
    an = anthropic.Anthropic(base_url=root(r), api_key=r["api_key"], max_retries=0)
    with pytest.raises(anthropic.UnprocessableEntityError) as e:
        an.messages.create(model="no spaces allowed", max_tokens=4, messages=CHAT)
    assert e.value.body["type"] == "error" and "not a role name" in e.value.body["error"]["message"]


def test_turn_rewards_go_to_the_latest_or_named_turn_and_stay_beside_the_final_reward(gateway):  # noqa: F811,E501
    (r,) = gateway.create(1)
    rid, key = r["rollout_id"], r["api_key"]
    agent = httpx.Client(base_url=root(r), headers={"Authorization": f"Bearer {key}"})
    oa = openai.OpenAI(base_url=r["base_url"], api_key=key)
    oa.chat.completions.create(model="solver", messages=CHAT, max_tokens=4)
    got = agent.post("/turn-rewards", json={"reward": 0.5, "name": "parsed"})
    assert got.status_code == 200 and got.json()["turn"] == 0 and got.json()["name"] == "parsed"
    oa.chat.completions.create(model="checker", messages=CHAT, max_tokens=4)
    assert agent.post("/turn-rewards", json={"reward": -1}).json()["turn"] == 1  # an int is fine
    assert agent.post("/turn-rewards", json={"reward": 0.25, "turn": 0}).json()["turn"] == 0
    agent.post("/rewards", json={"reward": 1.0}).raise_for_status()
    turns = turns_of(gateway, rid)
    assert [[(x["name"], x["reward"]) for x in t["rewards"]] for t in turns] == [
        [("parsed", 0.5), (None, 0.25)], [(None, -1.0)]]
    rec = gateway.admin.get(f"/rollouts/{rid}").json()
    assert rec["reward"] == 1.0  # the final reward is the rollout's
    gateway.admin.patch(f"/rollouts/{rid}", json={"state": "succeeded"}).raise_for_status()
    (loaded,) = gateway.store.load_rollouts(rollout_ids=[rid])
    assert [(t.role, t.reward) for t in loaded.turns] == [("solver", 0.75), ("checker", -1.0)]


@pytest.mark.parametrize("body,status,param", [
    ({"reward": 1.0, "turn": 5}, 422, "turn"),  # no such turn
    ({"reward": 1.0, "turn": -1}, 422, "turn"),
    ({"reward": "1.0"}, 422, "reward"),  # a string is not coerced
    ({"reward": True}, 422, "reward"),
    ({"reward": 1.0, "name": "has space"}, 422, "name"),
    ({"reward": 1.0, "name": "<b>"}, 422, "name"),
    ({"reward": 1.0, "extra": 1}, 422, "extra"),
    ({}, 422, "reward"),
])
def test_bad_turn_rewards_are_refused_naming_the_field(gateway, body, status, param):  # noqa: F811
    (r,) = gateway.create(1)
    agent = httpx.Client(base_url=root(r), headers={"Authorization": f"Bearer {r['api_key']}"})
    openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"]).chat.completions.create(
        model="solver", messages=CHAT, max_tokens=4)
    resp = agent.post("/turn-rewards", json=body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param
    assert gateway.store.get_turn_rewards(r["rollout_id"]) == []


def test_non_finite_turn_rewards_no_turn_yet_and_ended_rollouts_are_refused(gateway):  # noqa: F811
    (r,) = gateway.create(1)
    rid = r["rollout_id"]
    agent = httpx.Client(base_url=root(r), headers={"Authorization": f"Bearer {r['api_key']}",
                                                    "Content-Type": "application/json"})
    first = agent.post("/turn-rewards", json={"reward": 1.0})
    assert first.status_code == 422 and first.json()["error"]["param"] == "turn"
    assert "no turn yet" in first.json()["error"]["message"]
    openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"]).chat.completions.create(
        model="solver", messages=CHAT, max_tokens=4)
    for raw in (b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": -Infinity}'):
        resp = agent.post("/turn-rewards", content=raw)
        assert resp.status_code == 422 and resp.json()["error"]["param"] == "reward", resp.text
    other = gateway.create(1)[0]  # another rollout's key cannot reward this one
    stranger = httpx.post(f"{root(r)}/turn-rewards", json={"reward": 1.0},
                          headers={"Authorization": f"Bearer {other['api_key']}"})
    assert stranger.status_code in (401, 403, 404)
    gateway.admin.patch(f"/rollouts/{rid}", json={"state": "succeeded"}).raise_for_status()
    late = agent.post("/turn-rewards", json={"reward": 1.0})
    assert late.status_code == 409 and "ended" in late.json()["error"]["message"]
    admin_late = gateway.admin.post(f"/rollouts/{rid}/turn-rewards", json={"reward": 1.0})
    assert admin_late.status_code == 409
    assert gateway.store.get_turn_rewards(rid) == []


def test_a_role_can_be_served_by_its_own_engine(tmp_path):
    """Gateway.role_engines: a role's calls go to its engine whatever the rollout's engine."""
    main, frozen = FakeEngine(reply=lambda k, p: "main"), FakeEngine(reply=lambda k, p: "frozen")
    with live_gateway(tmp_path, main) as gw:
        gw.app.state.gateway.add_engine("frozen", frozen)
        gw.app.state.gateway.role_engines["checker"] = "frozen"
        (r,) = gw.create(1)
        oa = openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"])
        a = oa.chat.completions.create(model="solver", messages=CHAT, max_tokens=8)
        b = oa.chat.completions.create(model="checker", messages=CHAT, max_tokens=8)
        assert (a.choices[0].message.content, b.choices[0].message.content) == ("main", "frozen")
        assert len(main.calls) == len(frozen.calls) == 1
        assert [t.role for t in gw.store.get_turns(r["rollout_id"])] == ["solver", "checker"]
        gw.admin.close()


def chat(client: openai.OpenAI, role: str, history: list[dict]) -> None:
    """One call of `role` with its whole history, as an agent makes it; the answer and a next
    user message are appended to the history."""
    out = client.chat.completions.create(model=role, messages=history, max_tokens=16)
    history += [{"role": "assistant", "content": out.choices[0].message.content},
                {"role": "user", "content": "and?"}]


def test_a_roles_first_call_is_its_first_turn_whichever_engine_serves_it(tmp_path):
    """A role's first call, after another role's turns, renders in full as first_turn (on its own
    engine, whose memory holds nothing of the rollout, and on the same engine); forgotten is a
    call whose role made earlier calls the gateway no longer holds (a restart)."""
    main, frozen = FakeEngine(reply=lambda k, p: "main"), FakeEngine(reply=lambda k, p: "ok")
    serve = {"checker": "frozen", "judge": "frozen"}
    with live_gateway(tmp_path, main) as gw:
        gw.app.state.gateway.add_engine("frozen", frozen)
        gw.app.state.gateway.role_engines.update(serve)
        (r,) = gw.create(1)
        rid = r["rollout_id"]
        client = openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        solver = [{"role": "user", "content": "What is 6*7?"}]
        checker = [{"role": "system", "content": "Reply ok or redo."}, {"role": "user", "content": "42"}]
        for role, history in [("solver", solver), ("solver", solver), ("checker", checker),
                              ("checker", checker), ("planner", [{"role": "user", "content": "plan"}])]:
            chat(client, role, history)
        assert len(main.calls) == 3 and len(frozen.calls) == 2

        # A new gateway process on the same store: it holds no turn of the running rollout.
        app = create_app(gw.store, {"default": main, "frozen": frozen}, admin_key=gw.admin_key)
        app.state.gateway.role_engines.update(serve)
        with ThreadedServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/rollouts/{rid}/v1", api_key=r["api_key"],
                                   max_retries=0)
            for role, history in [("checker", checker), ("judge", [{"role": "user", "content": "?"}]),
                                  ("solver", solver), ("solver", solver)]:
                chat(client, role, history)
        got = [(t.role, t.context, t.context_reason) for t in gw.store.get_turns(rid)]
        gw.admin.close()
    assert got == [
        ("solver", "rendered", "first_turn"),
        ("solver", "exact", None),
        ("checker", "rendered", "first_turn"),  # on the frozen engine: its memory was empty
        ("checker", "exact", None),
        ("planner", "rendered", "first_turn"),  # on the solver's engine, its own conversation
        ("checker", "rendered", "forgotten"),  # after the restart
        ("judge", "rendered", "first_turn"),  # a role new after the restart (read from the store)
        ("solver", "rendered", "forgotten"),
        ("solver", "exact", None),
    ]


def sampled_ids(tok, text: str) -> list[int]:
    """`text` as a sampler may emit it: one token per character (not the tokenizer's own ids), then
    eos; re-tokenizing its text gives other ids."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]


@pytest.mark.parametrize("schedule", ["alternating", "bursts"])
def test_two_roles_on_one_engine_each_continue_their_own_turns(tmp_path, schedule):
    """A solver and a checker of one rollout, served by one engine, each with its own growing
    conversation: every call after a role's first continues that role's previous turn exactly
    (prompt = its prompt + response ids + the new messages), and the rows, one per role, have no
    break. `alternating`: one call each in turn, both roles opening alike and answering the same
    text with other ids, so the other role's latest turn matches a role's history too.
    `bursts`: KEEP + 1 solver calls between two checker calls."""
    engine = ScriptedEngine()
    tok = engine.tokenizer
    task = [{"role": "system", "content": "Task 7."}, {"role": "user", "content": "Go."}]
    if schedule == "alternating":
        order = ["solver", "checker"] * 4
        histories = {"solver": list(task), "checker": list(task)}
    else:
        order = (["solver"] * (KEEP + 1) + ["checker"]) * 2
        histories = {"solver": list(task), "checker": [{"role": "user", "content": "Check."}]}
    with live_gateway(tmp_path, engine) as gw:
        (r,) = gw.create(1)
        rid = r["rollout_id"]
        client = openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        for role in order:
            history = histories[role]
            text = f"guess {len(history) // 2}"
            engine.script.append(
                tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
                if role == "solver" else sampled_ids(tok, text)
            )
            out = client.chat.completions.create(model=role, messages=history)
            assert out.choices[0].message.content == text
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
        turns = turns_of(gw, rid)
        assert gw.admin.patch(f"/rollouts/{rid}", json={"state": "succeeded"}).status_code == 200
        rollouts = gw.store.load_rollouts(rollout_ids=[rid])
        gw.admin.close()
    assert [t["role"] for t in turns] == order
    for role in ("solver", "checker"):
        own = [t for t in turns if t["role"] == role]
        assert own[0]["context_reason"] == "first_turn"
        for before, turn in pairwise(own):
            held = before["prompt_ids"] + before["response_ids"]
            assert (turn["context"], turn["context_reason"]) == ("exact", None)
            assert turn["prompt_ids"][: len(held)] == held and turn["reused_tokens"] == len(held)
    _, metrics, breaks = aggregate(rollouts, max_prompt_length=2048, max_response_length=2048,
                                   tokenizer=tok, return_breaks=True)
    assert breaks == [] and metrics["n_rows"] == 2  # one row per role
