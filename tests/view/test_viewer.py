"""`tracetrain view` over a run made by a short real training run (tests/support/view_task.py: plain,
hostile, rewriting and failing agents): each page checked against the run's own data (the store,
metrics.jsonl, `tracetrain inspect`), escaping, missing and corrupt files, the token."""

from __future__ import annotations

import html
import math
import re
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from view_run import make_run, step_ids, store_rows

from tracetrain.view.app import create_view_app
from tracetrain.view.inspection import inspect_rollout


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("view") / "run")


@pytest.fixture(scope="module")
def client(run_dir) -> TestClient:
    with TestClient(create_view_app(run_dir)) as c:
        yield c


def table_ids(page: str) -> list[str]:
    return re.findall(r'<tr class="state-[a-z_]+" data-rollout="([^"]+)"', page)


def token_attrs(page: str, cls: str, attr: str) -> list[str]:
    """attr of every token span whose class list starts with `tok <cls>`."""
    return re.findall(rf'<span class="tok {cls}[^"]*"[^>]*? {attr}="([^"]*)"', page)


def test_run_page_shows_every_step_and_its_curves(client, run_dir):
    page = client.get("/").text
    steps = [int(s) for s in re.findall(r'<td><a href="/step/(\d+)">', page)]
    assert sorted(steps) == [0, 1]
    assert page.count("<svg") >= 4  # reward, loss, rows per rollout, ... from metrics.jsonl
    assert "view_task.py" in page  # the config
    assert client.get("/api/status").json() == {"steps": 2, "last_step": 1}


def test_step_page_lists_the_store_rollouts_and_filters_them(client, run_dir):
    stored = step_ids(run_dir, 1)
    page = client.get("/step/1").text
    assert sorted(table_ids(page)) == sorted(r[0] for r in stored)
    failed = {r[0] for r in stored if r[1] == "failed"}
    assert failed, "view_task's failing agent made no failed rollout"
    only = client.get("/step/1", params={"state": "failed-or-timed-out"}).text
    assert set(table_ids(only)) == failed
    broken = client.get("/step/1", params={"cause": "context_rewrite"}).text
    kinds = {rid: inspect_rollout(run_dir, rid, out=lambda *_: None)["breaks"] for rid, *_ in stored}
    assert set(table_ids(broken)) == {rid for rid, k in kinds.items() if "context_rewrite" in k} != set()
    by_reward = table_ids(client.get("/step/1", params={"sort": "reward", "order": "desc"}).text)
    rewards = {r[0]: r[2] for r in stored}
    ordered = [rewards[r] for r in by_reward if rewards[r] is not None]
    assert ordered == sorted(ordered, reverse=True)
    assert client.get("/step/1", params={"sort": "bogus"}).status_code == 400
    bad = client.get("/step/1", params={"min_reward": "abc"})
    assert bad.status_code == 400 and "min_reward must be a number" in bad.text
    # the form sends its empty boxes: no bound
    unbounded = client.get("/step/1", params={"min_reward": "", "max_reward": ""})
    assert table_ids(unbounded.text) == table_ids(page)
    low = table_ids(client.get("/step/1", params={"max_reward": "0.5"}).text)
    assert set(low) == {r[0] for r in stored if r[2] is not None and r[2] <= 0.5}
    assert client.get("/step/99").status_code == 404


def test_rollout_page_matches_the_trace_and_inspect(client, run_dir):
    for rid, state, reward, _ in step_ids(run_dir, 1):
        page = client.get(f"/rollout/{rid}").text
        assert f'<td class="state" id="state">{state}</td>' in page
        shown = inspect_rollout(run_dir, rid, out=lambda *_: None)
        if shown["loss_mass"] is None:
            continue
        # trained tokens: the responses of its turns (trajectory rows, nothing truncated)
        responses = store_rows(run_dir, "SELECT length(response_ids) / 4 FROM turns WHERE rollout_id = ?",
                               rid)
        weights = [float(w) for w in token_attrs(page, "trained", "data-w")]
        assert len(weights) == sum(n for (n,) in responses)
        # the weights shown sum to the rollout's loss mass, as inspect computes it
        assert math.fsum(weights) == pytest.approx(shown["loss_mass"], rel=1e-6)
        assert f'data-mass="{shown["loss_mass"]}"' in page
        assert (reward is None and "<td class=\"reward\"></td>" in page) or (
            f'<td class="reward">{reward:.4g}</td>' in page)
        # each break at the prompt position inspect reports
        marked = re.findall(r'<span class="tok prompt[^"]* at-break"[^>]*data-pos="(\d+)"', page)
        assert sorted(int(p) for p in marked) == sorted(p for _, p in shown.get("break_positions", []))


def test_a_failed_rollout_shows_its_traceback_and_turns(client, run_dir):
    rid, _, _, error = next(r for r in step_ids(run_dir, 0) if r[1] == "failed")
    page = client.get(f"/rollout/{rid}").text
    assert "RuntimeError" in page and html.escape("the tool crashed: <b>boom</b>") in page
    assert "<b>boom</b>" not in page
    assert "excluded (failed or timed out)" in page
    assert '<span class="tok response' in page  # its reply, shown, not trained


def test_trace_text_is_printed_never_run(client, run_dir):
    (rid,) = next(r for r in store_rows(
        run_dir, "SELECT rollout_id FROM rollouts WHERE task LIKE '%hostile%' ORDER BY seq"))
    page = client.get(f"/rollout/{rid}").text
    assert "<script>document" not in page and "</div><script>" not in page
    # printed: in the messages the agent sent (JSON, escaped), as the reader sees it
    assert "&lt;/div&gt;&lt;script&gt;document.title=" in page
    assert "</div><script>document.title='pwned'" in html.unescape(page)
    assert 'class="tok prompt bytes"' in page  # 漢字 🙂 split into byte tokens, marked


def test_compare_shows_two_rollouts(client, run_dir):
    a, b = [r[0] for r in step_ids(run_dir, 1)[:2]]
    page = client.get("/compare", params={"a": a, "b": b}).text
    assert 'class="side-by-side"' in page
    assert re.findall(r'<section class="rollout" data-rollout="([^"]+)"', page) == [a, b]
    assert client.get("/compare", params={"a": a, "b": "nope"}).status_code == 404


def test_missing_and_corrupt_files_name_themselves(run_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "metrics.jsonl").write_text((copy / "metrics.jsonl").read_text() + "{not json\n")
    with TestClient(create_view_app(copy)) as c:
        page = c.get("/").text
        assert "metrics.jsonl line 3 is not JSON" in page
        assert sorted(int(s) for s in re.findall(r'<td><a href="/step/(\d+)">', page)) == [0, 1]
    (copy / "traces.db").unlink()
    for extra in ("-wal", "-shm"):
        (copy / f"traces.db{extra}").unlink(missing_ok=True)
    with TestClient(create_view_app(copy)) as c:
        r = c.get("/step/0")
        assert r.status_code == 404 and "traces.db" in r.text and "no trace store" in r.text
        assert c.get("/").status_code == 200  # the curves still show
    (copy / "traces.db").write_bytes(b"this is not a database" * 100)
    with TestClient(create_view_app(copy)) as c:
        r = c.get("/step/0")
        assert r.status_code == 503 and "traces.db" in r.text and "Traceback" not in r.text
    (copy / "config.json").write_text("{")
    with TestClient(create_view_app(copy)) as c:
        r = c.get("/")
        assert r.status_code == 200 and "config.json" in r.text and "not readable as JSON" in r.text


def test_a_token_guards_every_page(run_dir):
    with TestClient(create_view_app(run_dir, token="s3cret-token")) as c:
        assert c.get("/").status_code == 401
        assert c.get("/static/view.css").status_code == 401
        assert c.get("/", params={"token": "wrong"}).status_code == 401
        assert c.get("/", params={"token": "s3cret-token"}).status_code == 200
        assert c.get("/step/0").status_code == 200  # the cookie it set


def test_each_chat_turn_keeps_the_messages_it_added(run_dir):
    """The store keeps what each turn was sent beyond the turn its prompt continues and that
    turn's answer (schema 5): the whole chat on a rollout's first call or a rendered one, then
    only the new observation."""
    import json

    (rid,) = store_rows(run_dir, "SELECT rollout_id FROM rollouts WHERE task LIKE '%hostile%' AND "
                        "n_turns >= 2 ORDER BY seq LIMIT 1")[0]
    turns = store_rows(run_dir, "SELECT context, messages FROM turns WHERE rollout_id = ? ORDER BY idx", rid)
    sent = [json.loads(m) for _, m in turns]
    assert [m["role"] for m in sent[0]] == ["system", "user"]
    for (context, _), later in zip(turns[1:], sent[1:], strict=True):
        assert context == "exact" and later == [{"role": "user", "content": "higher"}]
    (rewritten,) = store_rows(run_dir, "SELECT messages FROM turns t JOIN rollouts r USING (rollout_id)"
                              " WHERE r.task LIKE '%rewrite%' AND t.idx = 1 LIMIT 1")[0]
    assert [m["role"] for m in json.loads(rewritten)] == ["user", "assistant", "user"]  # rendered in full


def test_the_command_prints_its_url_when_ready_and_guards_other_hosts(run_dir):
    """`tracetrain view` prints `tracetrain view: URL` once it accepts connections (a client may
    connect at once, no retry); bound beyond loopback it makes a token and puts it in the URL."""
    import subprocess
    import sys

    import httpx

    def started(*args: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, "-m", "tracetrain", "view", str(run_dir),
                                 "--port", "0", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline().strip()
        assert line.startswith("tracetrain view: http://"), (line, proc.stderr.read() if proc.poll() else "")
        return proc, line.split(": ", 1)[1]

    proc, url = started()
    try:
        assert url.startswith("http://127.0.0.1:") and "token" not in url
        with httpx.Client(transport=httpx.HTTPTransport(retries=0), timeout=30) as http:
            assert http.get(url).status_code == 200
    finally:
        proc.kill()
        proc.wait(30)
    proc, url = started("--host", "0.0.0.0")
    try:
        assert "?token=" in url
        port = url.split(":")[2].split("/")[0]
        with httpx.Client(timeout=30) as http:
            assert http.get(f"http://127.0.0.1:{port}/").status_code == 401
            assert http.get(url.replace("0.0.0.0", "127.0.0.1")).status_code == 200
    finally:
        proc.kill()
        proc.wait(30)
    bad = subprocess.run([sys.executable, "-m", "tracetrain", "view", str(run_dir / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "is not a run directory" in bad.stderr


def test_each_taught_token_shows_its_teacher_logprob_and_both_parts_of_its_advantage(tmp_path):
    """A run with a teacher (config `distill`, with_reward): on the rollout page each trained
    token carries the teacher's logprob the store holds for it, and an advantage that is its
    distillation part, coef · (teacher − engine logprob), plus its reward-based part."""
    import json

    from view_run import TESTS, view_config

    from tracetrain.run.teacher import teacher_scores
    from tracetrain.run.trainer import train
    from tracetrain.store import SQLiteStore

    run = tmp_path / "run"
    taught = {"teacher": {"kind": "tiny", "hidden_size": 48, "num_layers": 2, "num_heads": 2,
                          "num_kv_heads": 1}, "with_reward": True, "coef": 0.5}
    train(view_config(run, 1, distill=json.dumps(taught)), base_dir=TESTS, log=lambda *_: None)
    store = SQLiteStore(run / "traces.db")
    try:
        scores = teacher_scores(store, [rid for rid, *_ in step_ids(run, 0)])
    finally:
        store.close()
    checked = 0
    with TestClient(create_view_app(run)) as c:
        for rid, *_ in step_ids(run, 0):
            page = c.get(f"/rollout/{rid}").text
            shown = {a: [float(x) for x in token_attrs(page, "trained", a)]
                     for a in ("data-tlp", "data-da", "data-ra", "data-a", "data-lp")}
            if not shown["data-a"]:
                continue
            want = [lp for k in sorted(scores[rid]) for lp in scores[rid][k]]
            assert shown["data-tlp"] == pytest.approx(want, abs=5e-5)  # (shown to 4 decimals)
            for t, d, r, a, lp in zip(*shown.values(), strict=True):
                assert d == pytest.approx(0.5 * (t - lp), abs=1e-4)
                assert a == pytest.approx(d + r, rel=1e-5, abs=1e-6)
            checked += 1
    assert checked
