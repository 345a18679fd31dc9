"""Continuous collection (tracetrain/run/continuous.py): the collector keeps its bounds for any
finishing order (property), max_staleness 0 is the step-synchronous run exactly, and a run whose
rollouts span weight updates trains every token within the bound, loses no request, records
each turn's version, and resumes."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.config import ConfigError, build_config
from tracetrain.run.continuous import Collector, group_specs
from tracetrain.run.step import rollout_specs

TESTS = Path(__file__).resolve().parents[1] / "support"


# --- the collector alone: groups finish in any order --------------------------------------------


@settings(max_examples=60, deadline=None)
@given(G=st.integers(1, 4), k=st.integers(0, 3), steps=st.integers(1, 6),
       lengths=st.lists(st.integers(0, 30), min_size=1, max_size=40))
def test_the_collector_keeps_its_bounds_whatever_order_groups_finish_in(G, k, steps, lengths):
    """Group n takes lengths[n % len] event-loop turns to finish. Then: no group is taken more
    than k versions after its launch; each is taken once; no more than (k+1) G are launched and
    untrained; a step takes G groups while G are left; with k = 0, step s takes groups s*G.."""

    async def main():
        version = 0
        launched_at: dict[int, int] = {}

        async def play(n: int) -> list:
            launched_at[n] = version
            for _ in range(lengths[n % len(lengths)]):
                await asyncio.sleep(0)
            return [n]

        c = Collector(play, lambda: version, groups_per_step=G, max_staleness=k, last_group=steps * G)
        c.launch()
        taken_all: list[int] = []
        for s in range(steps):
            assert len(c.groups) <= (k + 1) * G
            left = len(c.groups)
            taken = await c.take(version)
            assert taken.results == taken.numbers  # each group's results, group after group
            assert len(taken.numbers) >= min(G, left)
            for n in taken.numbers:
                assert version - c.groups[n].version <= k  # the staleness bound
                assert launched_at[n] >= c.groups[n].version  # its first call: never older
            if k == 0:
                assert taken.numbers == list(range(s * G, (s + 1) * G))
            taken_all += taken.numbers
            version += 1  # the update
            c.trained()
        assert len(taken_all) == len(set(taken_all))
        await c.aclose()

    asyncio.run(main())


def test_a_resumed_collector_launches_no_saved_group_past_its_last_step():
    """A checkpoint saved groups 6..11 for a 3-step run (G 4); resumed with 2 steps, groups 8..11
    (step 2) are past its end: only 6 and 7 are launched, and no never-launched one."""

    async def main():
        played: list[int] = []

        async def play(n: int) -> list:
            played.append(n)
            return [n]

        c = Collector(play, lambda: 0, groups_per_step=4, max_staleness=1, last_group=2 * 4,
                      next_group=12, redo=[6, 7, 8, 9, 10, 11])
        assert c.launch() == 2 and sorted(c.groups) == [6, 7]
        await c.take(1)
        assert sorted(played) == [6, 7]
        assert c.state()["redo"] == [6, 7]
        await c.aclose()

    asyncio.run(main())


def test_group_specs_are_the_step_synchronous_runs():
    tasks = [{"q": j} for j in range(3)]
    whole = rollout_specs(tasks, 2, "abc-s5")
    for j in range(3):
        specs, step = group_specs(tasks, 5 * 3 + j, 3, 2, "abc")
        assert step == 5 and specs == whole[2 * j:2 * j + 2]


def test_the_config_names_what_continuous_does_not_run_with():
    for extra, key in ((["rollout.agent_workers=2"], "rollout.agent_workers"),
                       (["backend=verl"], "trainer.collect"),
                       (["engine.kind=vllm", "engine.python=/usr/bin/python3", "engine.sleep_level=1"],
                        "engine.sleep_level")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            build_config({}, ["trainer.collect=continuous", *extra])


# --- real runs ------------------------------------------------------------------------------------


def config(run: Path, steps: int, *extra: str):
    return build_config({"task_args": {"slow_every": 0}}, [
        "task=continuous_task.py", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "warm_start.steps=0", "rollout.tasks_per_step=4", "rollout.n_per_task=3",
        "rollout.max_tokens=6", "optim.lr=2e-2", "optim.warmup_steps=0", f"trainer.steps={steps}",
        f"trainer.run_dir={run}", "trainer.seed=5", *extra])


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def answers(run: Path) -> dict[str, list]:
    """group (without the run's nonce) + rollout number -> its turns' (response ids, version)."""
    db = sqlite3.connect(run / "traces.db")
    try:
        rows = db.execute("SELECT rollout_id, response_ids, model_version FROM turns "
                          "ORDER BY rollout_id, idx").fetchall()
    finally:
        db.close()
    out: dict[str, list] = {}
    for rid, ids, version in rows:
        out.setdefault(rid.split("-", 1)[1], []).append((bytes(ids), version))
    return out


def rollout_ids(run: Path) -> set[str]:
    db = sqlite3.connect(run / "traces.db")
    try:
        return {r for (r,) in db.execute("SELECT rollout_id FROM rollouts")}
    finally:
        db.close()


@pytest.mark.slow
def test_max_staleness_0_is_the_step_synchronous_run(tmp_path):
    from tracetrain.run.trainer import train

    runs = {}
    for name, extra in (("step", ()), ("continuous", ("trainer.collect=continuous",))):
        train(config(tmp_path / name, 3, *extra), base_dir=TESTS, log=lambda *_: None)
        runs[name] = tmp_path / name
    a, b = metrics(runs["step"]), metrics(runs["continuous"])
    assert len(a) == len(b) == 3
    moved = False
    for x, y in zip(a, b, strict=True):
        # The engine batches the requests that arrive within its window, and continuous collection
        # starts each group's agents on their own: the batches differ, and with them the engine's
        # work counts and its fp32 logprobs, by float noise (~1e-7; the same weights, the same
        # tokens). Everything the seed decides is compared exactly; what the engine's logprobs feed
        # (the PPO ratio's old logprobs: the loss, its gradient, the gap) to that noise.
        assert x.keys() <= y.keys()  # (continuous adds collect/*)
        noisy = {k for k in x if k.startswith(("loss", "grad_norm", "engine/logprob_gap"))}
        same = {k for k in x if not k.startswith(("time/", "memory/", "engine/", "rollouts_per_s",
                                                  "trained_tokens_per_s")) and k not in noisy}
        assert {k: x[k] for k in same} == {k: y[k] for k in same}
        for k in noisy:
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), k
        assert y["collect/groups_taken"] == 4 and y["collect/groups_in_flight"] == 0
        moved = moved or x.get("grad_norm", 0.0) > 0.0
    assert moved  # the rewards differ within groups: the policy moved, and both runs alike
    assert answers(runs["step"]) == answers(runs["continuous"])


@pytest.mark.slow
def test_rollouts_spanning_weight_updates_train_within_the_bound_and_lose_no_request(tmp_path, monkeypatch):
    """Every other task waits 0.3 s after each call: its rollouts span updates. max_staleness 2:
    every trained token is at most 2 versions old, nothing is dropped or failed, and some rollouts
    hold turns of two versions, each recorded with its own. A run resumed from a checkpoint
    written while groups were in flight plays those groups again, then goes on."""


    from tracetrain.run import checkpoint
    from tracetrain.run.trainer import train

    run = tmp_path / "run"
    cfg = config(run, 3, "trainer.collect=continuous", "trainer.max_staleness=2",
                 "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10")  # each step's kept
    cfg = build_config({**json.loads(cfg.model_dump_json()),
                        "task_args": {"slow_every": 2, "slow_s": 0.3}}, [])
    train(cfg, base_dir=TESTS, log=lambda *_: None)
    rows = metrics(run)
    for m in rows:
        assert m["n_failed"] == 0 and m["n_timed_out"] == 0 and m["n_stale_rollouts"] == 0
        ages = [int(k.rsplit("_", 1)[1]) for k in m if k.startswith("staleness/tokens_")]
        assert ages and max(ages) <= 2
        assert m["collect/groups_taken"] == 4
    assert sum(m["staleness/mixed_version_rollouts"] for m in rows) > 0
    versions = {v for turns in answers(run).values() for _, v in turns}
    assert None not in versions and len(versions) > 1
    # the viewer's step page shows the groups each step trained, whichever step dealt them
    from tracetrain.view.read import RunDir

    view = RunDir(run)
    dealt_elsewhere = 0
    for m in rows:
        records = view.step_records(m["step"])
        assert sorted({r.group_id for r in records}) == sorted(m["collect/groups"])
        assert len(records) == 4 * 3  # whole groups
        dealt_elsewhere += sum(f"-s{m['step']}-" not in g for g in m["collect/groups"])
    assert dealt_elsewhere > 0  # (the slow games' groups were trained at later steps)
    view.close()
    # the checkpoint after step 1 (step 2 next) had groups in flight: resume from it
    state = checkpoint.load(run / "checkpoints" / "step-000002.pt")["collector"]
    assert state["redo"] and state["next_group"] > 8
    for later in ("step-000003.pt", "step-000003.pt.sha256"):  # the newest is now step 2's
        (run / "checkpoints" / later).unlink()
    before = rollout_ids(run)
    resumed = json.loads(cfg.model_dump_json())
    resumed["trainer"].update(steps=4, resume=True)
    train(build_config(resumed, []), base_dir=TESTS, log=lambda *_: None)
    assert [m["step"] for m in metrics(run)] == [0, 1, 2, 3]
    new = {rid.split("-", 1)[1].rsplit("-n", 1)[0] for rid in rollout_ids(run) - before}  # resumed run's
    for n in state["redo"]:  # each launched again
        assert f"s{n // 4}-t{n % 4}" in new
    trained = [n for n in range(state["next_group"]) if n not in state["redo"]]
    assert not any(f"s{n // 4}-t{n % 4}" in new for n in trained)  # trained before: not again


@pytest.mark.slow
def test_corrections_in_a_run_see_the_gap_that_staleness_makes(tmp_path):
    """Continuous collection, max_staleness 1, rollout-level truncated IS against the trainer's
    proximal logprobs: a step whose rollouts all came from the current weights has a log-ratio of
    float noise (the same fp32 weights in the engine and the trainer) and weights of 1; a step with
    one-version-old rollouts has a real gap, and its weights move off 1 (within the cap)."""
    from tracetrain.run.trainer import train

    run = tmp_path / "run"
    train(config(run, 4, "trainer.collect=continuous", "trainer.max_staleness=1",
                 "correction.old=trainer", "correction.weight=rollout", "correction.cap=3",
                 "optim.lr=5e-2"), base_dir=TESTS, log=lambda *_: None)
    rows = metrics(run)
    fresh = [m for m in rows
             if set(k for k in m if k.startswith("staleness/rollouts_")) == {"staleness/rollouts_0"}]
    stale = [m for m in rows if m.get("staleness/rollouts_1", 0) == 12]
    assert fresh and stale
    for m in fresh:
        assert m["correction/abs_log_ratio_max"] < 1e-4
        assert m["correction/weight_max"] == pytest.approx(1.0, abs=1e-3)
    for m in stale:
        assert m["correction/abs_log_ratio_max"] > 1e-3
        assert m["correction/weight_max"] <= 3.0
        assert m["correction/weight_mean"] != pytest.approx(1.0, abs=1e-6)
        assert m["n_failed"] == 0 and m["correction/rejected_rollouts"] == 0


def records(run: Path) -> dict:
    """rollout id -> its record in the run's traces.db."""
    from tracetrain.store import SQLiteStore

    with SQLiteStore(run / "traces.db", read_only=True) as store:
        return {r.rollout_id: r for r in store.list_rollouts(limit=1_000_000)}


@pytest.mark.slow
def test_rollouts_still_running_when_the_run_ends_are_failed_never_trained_and_counted(tmp_path, monkeypatch):
    """Task 0 of each step waits 60 s after each call: its groups are still running when a run
    stopped by an error after its first step's checkpoint ends. It leaves no rollout queued or
    running in traces.db: those were failed with the error NEVER_TRAINED and no reward, none was
    trained, the viewer and `tracetrain inspect` show them failed. The run resumed from that
    checkpoint for 2 steps (task 0 now quick) plays the saved groups of steps 0 and 1 again, none
    of step 2's (past its end); what it leaves running at its end is cancelled and counted."""
    from fastapi.testclient import TestClient

    from tracetrain.run.step import NEVER_TRAINED
    from tracetrain.run.trainer import Trainer, train
    from tracetrain.view.app import create_view_app
    from tracetrain.view.inspection import inspect_rollout

    saved = Trainer.save_checkpoint

    def save_then_fail(self, *args, **kwargs):
        saved(self, *args, **kwargs)
        raise RuntimeError("stopped after the checkpoint")

    run = tmp_path / "run"
    cfg = config(run, 3, "trainer.collect=continuous", "trainer.max_staleness=2",
                 "trainer.checkpoint_every=1", "rollout.timeout_s=300")
    cfg = build_config({**json.loads(cfg.model_dump_json()),
                        "task_args": {"slow_every": 4, "slow_s": 60.0}}, [])
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "save_checkpoint", save_then_fail)
        with pytest.raises(RuntimeError, match="stopped after the checkpoint"):
            train(cfg, base_dir=TESTS, log=lambda *_: None)
    first = records(run)
    trained = metrics(run)[0]["collect/groups"]
    assert first and not [r for r in first.values() if not r.state.terminal]
    ended = sorted(i for i, r in first.items() if r.error == NEVER_TRAINED)
    slow = sorted(i for i, r in first.items() if r.group_id.endswith("-t0"))
    assert len(slow) == 3 * 3 and set(slow) <= set(ended)  # the three steps' task 0
    for i in ended:
        assert first[i].state.value == "failed" and first[i].reward is None
        assert first[i].group_id not in trained

    resumed = json.loads(cfg.model_dump_json())
    resumed["trainer"].update(steps=2, resume=True)  # (the checkpoint's next step is 1)
    resumed["task_args"]["slow_s"] = 0.0
    out = train(build_config(resumed, []), base_dir=TESTS, log=lambda *_: None)
    assert [m["step"] for m in metrics(run)] == [0, 1]
    second = {i: r for i, r in records(run).items() if i not in first}
    groups = {r.group_id.split("-", 1)[1] for r in second.values()}  # (without the run's nonce)
    assert {g.split("-")[0] for g in groups} == {"s0", "s1"}  # none of step 2's
    taken = set(metrics(run)[1]["collect/groups"])
    assert len(taken) == 4 and taken <= {r.group_id for r in second.values()}
    # a group of steps 0-1 that step 0 did not train (it took one of step 2's that had finished)
    # and step 1 did not take may still be running at the end: cancelled, never trained, counted
    assert not [r for r in second.values() if not r.state.terminal]
    cancelled = [i for i, r in second.items() if r.error == NEVER_TRAINED]
    assert not [i for i in cancelled if second[i].group_id in taken]
    assert all(second[i].state.value == "succeeded" for i in second if i not in cancelled)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["cancelled_at_end_rollouts"] == out["cancelled_at_end_rollouts"] == len(cancelled)

    with TestClient(create_view_app(run)) as client:
        page = client.get(f"/rollout/{ended[0]}")
    assert page.status_code == 200 and 'id="state">failed<' in page.text and NEVER_TRAINED in page.text
    shown: list[str] = []
    inspect_rollout(run, ended[0], out=shown.append)
    assert "state failed" in shown[0] and "excluded from training" in shown[-1]
