"""examples/guess/checker.yaml end to end, small: a guesser that trains and a checker served by a
frozen copy of the policy, rewards along the way, credit per turn; the frozen copy never takes the
trainer's weights, a resumed run keeps it and the turn rewards, and the checker's calls train no
token."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
import yaml

from tracetrain.config import build_config
from tracetrain.run.trainer import train
from tracetrain.store import SQLiteStore

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "guess"


def small(run_dir: Path, steps: int, **extra):
    data = yaml.safe_load((EXAMPLE / "checker.yaml").read_text())
    overrides = [
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "warm_start.steps=3", "warm_start.batch_size=8",
        "rollout.tasks_per_step=3", "rollout.n_per_task=4", "rollout.timeout_s=60",
        "optim.lr=1e-2", "optim.warmup_steps=0", "engine.threads=1",
        "loss.entropy_coef=0.01",  # the policy moves even when every advantage is 0
        f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", "trainer.seed=5",
        "trainer.eval_every=0",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return build_config(data, overrides)


def turns_by_role(run_dir: Path) -> dict[str, list[tuple[int, int]]]:
    """role -> [(step, model_version)] of every call of the run."""
    db = sqlite3.connect(run_dir / "traces.db")
    out: dict[str, list] = {}
    for gid, role, version in db.execute(
            "SELECT r.group_id, t.role, t.model_version FROM turns t JOIN rollouts r USING (rollout_id)"):
        step = int(gid.rsplit("-t", 1)[0].rsplit("-s", 1)[1])
        out.setdefault(role or "policy", []).append((step, version))
    db.close()
    return out


@pytest.mark.slow
def test_a_frozen_checker_and_a_trained_guesser_with_turn_credit(tmp_path):
    run = tmp_path / "run"
    train(small(run, 1), base_dir=EXAMPLE, log=lambda *_: None)
    first = torch.load(run / "checkpoint.pt", weights_only=False)
    assert first["frozen"] is not None
    train(small(run, 3, **{"trainer.resume": "true"}), base_dir=EXAMPLE, log=lambda *_: None)
    last = torch.load(run / "checkpoint.pt", weights_only=False)

    # The frozen copy is the same after three updates and a resume; the policy moved.
    assert first["frozen"].keys() == last["frozen"].keys()
    assert all(torch.equal(first["frozen"][k], last["frozen"][k]) for k in first["frozen"])
    assert any(not torch.equal(first["model"][k], last["model"][k]) for k in first["model"])
    # Every checker call came from the frozen engine (version 0 throughout); the guesser's from
    # the policy as it was at each step.
    roles = turns_by_role(run)
    assert set(roles) == {"guesser", "checker"}
    assert {v for _, v in roles["checker"]} == {0}
    assert sorted({(s, v) for s, v in roles["guesser"]}) == [(0, 0), (1, 1), (2, 2)]

    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["roles/checker/trained"] == 0.0 and m["roles/guesser/trained"] == 1.0
        assert m["roles/checker/turns"] > 0 and m["turn_rewards/count"] == m["roles/guesser/turns"]
        assert m["n_stale_rollouts"] == 0  # the frozen checker's version 0 is never stale
        # only the guesser's tokens train: every trained token is a guesser response token
        assert m["aggregate/tokens/trained"] == m["roles/guesser/response_tokens"]

    with SQLiteStore(run / "traces.db") as store:  # turn rewards survived the resume
        (r,) = [x for x in store.load_rollouts() if "-s0-" in x.group_id][:1]
        assert all((t.reward is not None) == (t.role == "guesser") for t in r.turns)
