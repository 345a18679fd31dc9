"""Property test of the HTTP API from its own OpenAPI schema (schemathesis strategies driven by
hypothesis): whatever the request, valid by the schema or not, the gateway never answers 5xx (the
fake engine never fails here) and every error is a JSON error body.

Requests go to a live uvicorn server on loopback with the admin key (it reaches every route) or,
on a rollout's own routes, that rollout's key; path ids are random or real rollouts. Each route
also gets one explicit valid request (a hypothesis `@example`, always run first): it must succeed,
so every route is reached past its validation whatever the random draw. FUZZ_EXAMPLES (default
40) sets the number of random requests per route (`FUZZ_EXAMPLES=400 pytest
tests/gateway/test_gateway_fuzz.py` for a longer search).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

import httpx
import pytest
import schemathesis
from gateway_fixtures import FakeEngine
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tracetrain.gateway import create_app
from tracetrain.gateway.serve import ThreadedServer
from tracetrain.store import SQLiteStore

ADMIN = "admin-" + secrets.token_hex(16)


def _openapi() -> dict:
    with tempfile.TemporaryDirectory() as d:
        store = SQLiteStore(Path(d) / "schema.db")
        try:
            return create_app(store, FakeEngine(record=False), admin_key=ADMIN).openapi()
        finally:
            store.close()


SCHEMA = schemathesis.openapi.from_dict(_openapi())
OPERATIONS = [op.ok() for op in SCHEMA.get_all_operations()]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    store = SQLiteStore(tmp_path_factory.mktemp("fuzz") / "fuzz.db")
    app = create_app(
        store,
        FakeEngine(record=False),
        admin_key=ADMIN,
        max_body_bytes=256 * 1024,
        engine_factory=lambda spec, gw: FakeEngine(record=False),
    )
    with ThreadedServer(app) as server:
        yield server.url
    store.close()


def real_rollouts(url: str, n: int = 2) -> dict[str, str]:
    """n fresh rollouts for one operation (earlier operations may have ended or deleted theirs)."""
    made = httpx.post(
        url + "/rollouts",
        json={"rollouts": [{}] * n},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=60,
    ).json()["rollouts"]
    return {r["rollout_id"]: r["api_key"] for r in made}


def cases(op, real_ids):
    """Positive and negative cases; on rollout routes most of them name a real rollout."""
    strategies = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategies.append(op.as_strategy(mode))
        if "{rollout_id}" in op.path:
            for rid in real_ids:
                strategies.append(op.as_strategy(mode, path_parameters={"rollout_id": rid}))
    return st.one_of(strategies)


def valid_request(op, rid: str) -> dict:
    """One request that `op` must accept (path parameters, query, body) on real rollout `rid`."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {
        "POST /rollouts": {"body": {"rollouts": [{"group_id": "fuzz-g", "task": {"n": 1}}]}},
        "GET /rollouts": {"query": {"state": "queued", "limit": 5}},
        "PATCH /rollouts": {"body": {"rollouts": [{"rollout_id": rid, "state": "running"}]}},
        "GET /rollouts/{rollout_id}": {},
        "PATCH /rollouts/{rollout_id}": {"body": {"state": "running"}},
        "DELETE /rollouts/{rollout_id}": {},
        "POST /rollouts/{rollout_id}/rewards": {"body": {"reward": 0.5, "info": {"why": "ok"}}},
        "POST /rollouts/{rollout_id}/events": {"body": {"kind": "note", "payload": [1, "a"]}},
        "GET /rollouts/{rollout_id}/events": {},
        "POST /rollouts/{rollout_id}/v1/chat/completions": {"body": chat},
        "POST /rollouts/{rollout_id}/v1/completions": {"body": {"prompt": [5, 6, 7], "max_tokens": 2}},
        "POST /rollouts/{rollout_id}/v1/responses": {"body": {"input": "hi", "max_output_tokens": 2}},
        "POST /rollouts/{rollout_id}/v1/messages": {
            "body": {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}},
        "GET /rollouts/{rollout_id}/v1/models": {},
        "POST /rollouts/{rollout_id}/turn-rewards": {"body": {"reward": 0.5, "name": "fuzz"}},
        **{f"{m} /rollouts/{{rollout_id}}/roles/{{role}}/v1/{route}": {
            **v, "path_parameters": {"role": "checker"}}
           for (m, route), v in {
               ("POST", "chat/completions"): {"body": chat},
               ("POST", "completions"): {"body": {"prompt": [5, 6, 7], "max_tokens": 2}},
               ("POST", "responses"): {"body": {"input": "hi", "max_output_tokens": 2}},
               ("POST", "messages"): {"body": {"max_tokens": 2, "model": "m",
                                               "messages": [{"role": "user", "content": "hi"}]}},
               ("GET", "models"): {}}.items()},
        "GET /engines": {},
        "POST /engines": {"body": {"name": "fuzz-engine", "base_url": "http://127.0.0.1:9", "model": "m"}},
        "POST /engines/{name}/pause": {"path_parameters": {"name": "default"}},
        "POST /engines/{name}/resume": {"path_parameters": {"name": "default"}},
        "POST /engines/{name}/drain": {"path_parameters": {"name": "default"}, "query": {"timeout_s": 1}},
        "GET /health": {},
    }[f"{op.method.upper()} {op.path}"]


def explicit_case(op, rid: str):
    request = valid_request(op, rid)
    params = {**({"rollout_id": rid} if "{rollout_id}" in op.path else {}),
              **request.get("path_parameters", {})} or None
    kwargs = {"body": request["body"], "media_type": "application/json"} if "body" in request else {}
    return op.Case(path_parameters=params, query=request.get("query"), **kwargs)


def agent_route(method: str, path: str) -> bool:
    return method.upper() == "POST" and (
        "/v1/" in path or path.endswith(("/rewards", "/turn-rewards", "/events")))


@pytest.mark.slow
@pytest.mark.parametrize("op", OPERATIONS, ids=[f"{o.method.upper()} {o.path}" for o in OPERATIONS])
def test_no_5xx_from_any_request(live, op):
    url = live
    keys = real_rollouts(url)
    if op.path.endswith("/turn-rewards"):  # a turn to give rewards to
        for rid, key in keys.items():
            httpx.post(f"{url}/rollouts/{rid}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                       headers={"Authorization": f"Bearer {key}"}, timeout=60).raise_for_status()
    statuses = set()

    explicit = explicit_case(op, next(iter(keys)))

    @settings(
        max_examples=int(os.environ.get("FUZZ_EXAMPLES", 40)), deadline=None,
        suppress_health_check=list(HealthCheck), database=None
    )
    @given(case=cases(op, list(keys)), use_rollout_key=st.booleans())
    @example(case=explicit, use_rollout_key=False)
    def check(case, use_rollout_key):
        rid = (case.path_parameters or {}).get("rollout_id")
        key = (
            keys[rid]
            if use_rollout_key and rid in keys and agent_route(op.method, op.path)
            else ADMIN
        )
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {key}"}
        response = case.call(base_url=url, timeout=30)
        assert response.status_code < 500, (case.method, case.formatted_path, response.text[:300])
        statuses.add(response.status_code)
        if case is explicit:
            assert response.status_code in (200, 201, 204), (op.path, response.text[:300])
        if response.status_code >= 400 and op.path.endswith("/v1/messages"):  # Anthropic's shape
            body = response.json()
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
        elif response.status_code >= 400:
            assert response.json()["error"]["code"] == response.status_code
        if op.path.endswith(("/pause", "/drain")):  # leave the engine open for the next operations
            httpx.post(
                url + "/engines/default/resume",
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=60,
            )

    check()
    # The generated requests reached the route, not only its validation.
    assert statuses & {200, 204, 404, 409}, statuses
