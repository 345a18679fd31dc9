"""The viewer shows tool use and expert demonstrations: a step's tools/* metrics (its page and the
run's curves), each turn's tool stats (the rollout page) and their sum per rollout (the step's
table), and an "expert" badge on rollouts played by the engine "expert". The run directory is
made by hand: a store with known turns, metrics.jsonl with known numbers."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tracetrain.store import NewRollout, NewTurn, SQLiteStore
from tracetrain.types import ToolStats
from tracetrain.view.app import create_view_app

STEP0 = {"step": 0, "reward_mean": 0.5, "tools/calls_per_rollout": 1.5, "tools/rollouts_with_call": 0.5,
         "tools/parse_failures": 1, "tools/unknown": 2, "tools/errors": 3}
STEP1 = {"step": 1, "reward_mean": 0.25}  # no rollout of it was offered tools


async def fill(store: SQLiteStore) -> None:
    await store.create_rollouts([
        NewRollout(rid, group, None, engine, b"s" + rid.encode(), b"h" + rid.encode())
        for rid, group, engine in (("pol", "run-s0-t0", None), ("exp", "run-s0-t0", "expert"),
                                   ("plain", "run-s1-t0", None))])
    await store.add_turn("pol", NewTurn([1, 2], [3, 4], [-0.5, -0.5], 0, "stop",
                                        tools=ToolStats(2, 1, 1)))
    await store.add_turn("pol", NewTurn([1, 2, 3, 4, 5], [6], [-0.5], 0, "stop",
                                        tools=ToolStats(1, 0, 1)))
    await store.add_turn("pol", NewTurn([1, 2, 3, 4, 5, 6, 7], [8], [-0.5], 0, "stop"))
    await store.add_turn("exp", NewTurn([1, 2], [9], [-0.5], 0, "stop", tools=ToolStats(0, 0, 0)))
    await store.add_turn("plain", NewTurn([1, 2], [3], [-0.5], 1, "stop"))
    for rid, reward in (("pol", 1.0), ("exp", 0.0), ("plain", 0.25)):
        await store.add_event(rid, "reward", None, reward=reward)
        await store.set_state(rid, "succeeded")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    run = Path(tmp_path_factory.mktemp("tools")) / "run"
    run.mkdir()
    store = SQLiteStore(run / "traces.db")
    try:
        asyncio.run(fill(store))
    finally:
        store.close()
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in (STEP0, STEP1)))
    with TestClient(create_view_app(run)) as c:
        yield c


def cells(page: str, rid: str) -> str:
    """The step table's row of rollout `rid`."""
    (row,) = re.findall(rf'<tr class="state-[a-z_]+" data-rollout="{rid}">(.*?)</tr>', page, re.S)
    return row


def test_the_step_page_shows_its_tool_metrics_and_marks_the_expert(client):
    page = client.get("/step/0").text
    shown = dict(re.findall(r'<span data-metric="(tools/[a-z_]+)">([^<]*)</span>', page))
    assert shown == {"tools/calls_per_rollout": "1.5", "tools/rollouts_with_call": "0.5",
                     "tools/parse_failures": "1", "tools/unknown": "2", "tools/errors": "3"}
    assert 'class="badge expert"' in cells(page, "exp") and "badge" not in cells(page, "pol")
    assert '<td class="tools">3 calls, 1 unparsed, 2 unknown tools</td>' in cells(page, "pol")
    assert '<td class="tools">0 calls</td>' in cells(page, "exp")
    later = client.get("/step/1").text
    assert 'id="step-tools"' not in later and '<td class="tools"></td>' in cells(later, "plain")


def test_the_rollout_page_shows_each_turns_tool_stats_and_the_expert_badge(client):
    page = client.get("/rollout/pol").text
    assert re.findall(r'<td class="tools">([^<]*)</td>', page) == [
        "2 calls, 1 unparsed, 1 unknown tool", "1 call, 1 unknown tool", ""]
    assert 'class="badge expert"' not in page
    expert = client.get("/rollout/exp").text
    assert re.search(r'<h1>rollout <span class="rid">exp</span> <span class="badge expert"', expert)


def test_the_run_page_draws_the_tool_curves(client):
    page = client.get("/").text
    titles = re.findall(r"<figcaption>([^<]*)</figcaption>", page)
    assert {"tool calls per rollout", "rollouts with a tool call", "tool failures"} <= set(titles)
    legend = page.split("<figcaption>tool failures</figcaption>")[1].split("</figure>")[0]
    assert [s.strip() for s in re.findall(r"■</span> ([^<]*?) \d", legend)] == [
        "tools/parse_failures", "tools/unknown", "tools/errors"]
