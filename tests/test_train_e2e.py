"""The main job, end to end, small: the guess demo through a live gateway on loopback, agents on
the real openai SDK, turns in SQLite, rows, advantages, PPO updates, version bumps, checkpoints,
and a resume that continues the same run."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from tracetrain.agents.tasks import load_task
from tracetrain.config import build_config
from tracetrain.run.trainer import Trainer, train

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "guess"


def small_config(run_dir: Path, steps: int, **extra):
    overrides = [
        "task=task.py",
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "warm_start.steps=3", "warm_start.batch_size=8",
        "rollout.tasks_per_step=3", "rollout.n_per_task=4", "rollout.timeout_s=60",
        "optim.lr=1e-2", "optim.warmup_steps=0", "optim.mini_batches=2",
        "optim.micro_batch_tokens=64",
        f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", "trainer.seed=3",
        "trainer.eval_every=2", "trainer.eval_tasks=4",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return build_config({"task_args": {"high": 4, "max_turns": 3}}, overrides)


def ids_of_step(run_dir: Path, step: int) -> list[str]:
    db = sqlite3.connect(run_dir / "traces.db")
    ids = [r[0] for r in db.execute("SELECT rollout_id FROM rollouts WHERE group_id LIKE ?",
                                    (f"%-s{step}-t%",))]
    db.close()
    return ids


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_records_learns_checkpoints_and_resumes(tmp_path, capsys):
    # Weights before any update (same seed -> the same initial model and warm start).
    probe = Trainer(small_config(tmp_path / "probe", 1), load_task("task.py", EXAMPLE))
    initial = {k: v.clone() for k, v in probe.learner.model.state_dict().items()}

    run = tmp_path / "run"
    out = train(small_config(run, 2), base_dir=EXAMPLE, log=lambda *_: None)
    rows = read_metrics(run)
    assert [m["step"] for m in rows] == [0, 1]
    for m in rows:
        assert m["aggregate/n_rows"] > 0 and m["aggregate/n_rollouts"] > 0
        assert torch.isfinite(torch.tensor(m["loss"]))
        # How prompts were built (gateway context: exact): each rollout's first call renders the
        # template, every later call of the guessing game continues the one before it.
        db = sqlite3.connect(run / "traces.db")
        ids = ids_of_step(run, m["step"])
        n_turns = db.execute(f"SELECT count(*) FROM turns WHERE rollout_id IN ({','.join('?' * len(ids))})",
                             ids).fetchone()[0]
        db.close()
        assert m["context/rendered/first_turn"] == len(ids) == 3 * 4
        assert m["context/exact"] == n_turns - len(ids)
        assert m["context/rendered/no_match"] == m["context/rendered/template_prefix"] == 0
        assert m["aggregate/breaks/total"] == 0
        assert 0.0 <= m["reward_mean"] <= 1.0
        # The update computed the rollouts' shared prompt once (packed rows, shared prefixes):
        # fewer tokens than the rows hold; the step's peak memory is reported.
        real = m["aggregate/tokens/non_pad"] / 2  # per update: the run trains 2 mini-batches
        assert 0 < m["loss/tokens_computed"] < real <= m["loss/tokens_padded"]
        assert 0.1 < m["memory/peak_rss_gb"] < 24
    assert [m["model_version"] for m in rows] == [1, 2]  # one bump per step
    assert "eval/reward_mean" in rows[1]
    # the untrained policy's eval, before step 0, is in step 0's metrics and the summary
    assert 0.0 <= rows[0]["eval/initial_reward_mean"] <= 1.0 and "eval/initial_reward_mean" not in rows[1]
    assert out["eval_initial"] == rows[0]["eval/initial_reward_mean"] and out["target_gain"] == 0.3
    assert (run / "curve.png").stat().st_size > 1000 and out["steps"] == 2

    # Turns were recorded by the gateway with token ids and the engine's model version.
    db = sqlite3.connect(run / "traces.db")
    n_turns, versions = db.execute(
        "SELECT count(*), group_concat(DISTINCT model_version) FROM turns").fetchone()
    assert n_turns >= 2 * 3 * 4
    assert set(map(int, versions.split(","))) >= {0, 1}
    db.close()

    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 2
    changed = [k for k, v in ck["model"].items() if not torch.equal(v, initial[k])]
    assert changed, "no weight changed after two RL steps"

    # `tracetrain inspect` follows one rollout of the run down the path of the data.
    from tracetrain.cli import main

    assert main(["inspect", str(run), "--rollout", ids_of_step(run, 1)[0]]) == 0
    shown = capsys.readouterr().out
    assert "turn 0 [policy] (model_version 1)" in shown and "advantage" in shown and "loss mass" in shown
    assert "prompt rendered in full (first_turn)" in shown  # how the turn's prompt was built
    # The mass of the mini-batch the rollout was trained in (the run trains 2 per step): 1/R of
    # that mini-batch in rollout-mean.
    from tracetrain.view.inspection import inspect_rollout

    figures = inspect_rollout(run, ids_of_step(run, 1)[0], out=lambda *_: None)
    assert figures["n_mini_batches"] == 2 and f"of 2: {figures['n_rollouts_in_mini_batch']} of" in shown
    assert figures["n_rollouts_in_mini_batch"] < figures["n_rollouts_in_step"]
    assert figures["loss_mass"] == pytest.approx(1 / figures["n_rollouts_in_mini_batch"], rel=1e-5)

    # Resume: two more steps continue the run (steps 2 and 3, versions 3 and 4).
    train(small_config(run, 4, **{"trainer.resume": "true"}), base_dir=EXAMPLE, log=lambda *_: None)
    rows = read_metrics(run)
    assert [m["step"] for m in rows] == [0, 1, 2, 3]
    assert [m["model_version"] for m in rows[2:]] == [3, 4]

    # Same seed, 4 steps straight: the same metrics as 2 + resume 2 (sampling is seeded per
    # rollout and turn, tasks are a function of (seed, step)).
    straight = tmp_path / "straight"
    train(small_config(straight, 4), base_dir=EXAMPLE, log=lambda *_: None)
    a, b = read_metrics(run), read_metrics(straight)
    for x, y in zip(a, b, strict=True):
        assert x["reward_mean"] == y["reward_mean"]
        assert x["aggregate/n_rows"] == y["aggregate/n_rows"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-6)


def test_ppo_update_ignores_left_padding_columns():
    """Rows padded to a wider prompt block give the same update as the tight batch."""
    import copy

    from tracetrain.learn.update import ppo_update
    from tracetrain.models import tiny
    from tracetrain.rows.aggregate import aggregate
    from tracetrain.types import Rollout, Turn

    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    model = tiny.build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    rollouts = [
        Rollout(f"r{k}", f"g{k // 2}", [Turn(list(range(3, 8 + 3 * k)), [40 + k, 41, 2], [-1.0, -0.5, -0.2])],
                reward=float(k % 2))
        for k in range(4)
    ]
    tight, _ = aggregate(rollouts, max_prompt_length=64, max_response_length=8)
    wide, _ = aggregate(rollouts, max_prompt_length=64, max_response_length=8, pad_to_limits=True)
    assert wide.prompt_length > tight.prompt_length
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    cfg = build_config({}, ["optim.grad_clip=1e9"])
    grads = []
    for batch in (tight, wide):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        (res,) = ppo_update(m, opt, batch, adv, cfg)
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
        assert torch.isfinite(torch.tensor(res.loss))
    # padded wider or not: the same fp32 terms, other matmul shapes (<~ 100 u = 6e-6 relative)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_stale_rollouts_are_dropped_and_counted():
    from tracetrain.run.step import drop_stale
    from tracetrain.types import Rollout, Turn

    def rollout(rid, versions):
        return Rollout(rid, "g", [Turn([1], [2], model_version=v) for v in versions], reward=1.0)

    rs = [rollout("fresh", [5, 5]), rollout("one-old", [4, 5]), rollout("two-old", [3, 5]),
          rollout("unknown", [None])]
    kept, n = drop_stale(rs, current_version=5, max_staleness=1)
    assert [r.rollout_id for r in kept] == ["fresh", "one-old", "unknown"] and n == 1
    kept, n = drop_stale(rs, current_version=5, max_staleness=0)
    assert [r.rollout_id for r in kept] == ["fresh", "unknown"] and n == 2


def test_reference_kl_enters_the_update():
    """kl_coef > 0 with a reference model: KL 0 against itself, > 0 against another model, and the
    KL term changes the gradient."""
    import copy

    from tracetrain.learn.update import ppo_update
    from tracetrain.models import tiny
    from tracetrain.rows.aggregate import aggregate
    from tracetrain.types import Rollout, Turn

    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    model = tiny.build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    other = tiny.build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=1)
    rollouts = [Rollout(f"r{k}", "g", [Turn([3, 4, 5 + k], [40 + k, 41, 2], [-1.0, -0.5, -0.2])],
                        reward=float(k % 2)) for k in range(4)]
    batch, _ = aggregate(rollouts, max_prompt_length=16, max_response_length=8)
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0])

    def update(ref, kl_coef):
        m = copy.deepcopy(model)
        cfg = build_config({}, [f"loss.kl_coef={kl_coef}", "optim.grad_clip=1e9"])
        (res,) = ppo_update(m, torch.optim.SGD(m.parameters(), lr=0.0), batch, adv, cfg, ref_model=ref)
        return res, torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    same, _ = update(copy.deepcopy(model), 0.5)
    assert abs(same.metrics["kl_ref"]) < 1e-6
    far, g_kl = update(other, 0.5)
    assert far.metrics["kl_ref"] > 1e-3
    _, g_plain = update(other, 0.0)
    assert not torch.allclose(g_kl, g_plain)


def test_a_new_run_never_writes_into_an_earlier_one(tmp_path):
    """Fresh run into a used run_dir: refused, naming the key, the earlier files untouched.
    resume=true: from the checkpoint, metrics.jsonl holds each step once (lines logged after the
    checkpoint are dropped and run again); with no checkpoint, the run starts over."""
    from tracetrain.config import ConfigError

    run = tmp_path / "run"
    train(small_config(run, 2, **{"trainer.eval_every": 0}), base_dir=EXAMPLE, log=lambda *a: None)
    before = {n: (run / n).read_bytes() for n in ("metrics.jsonl", "config.json")}
    with pytest.raises(ConfigError, match=r"trainer\.run_dir.*already holds a run.*metrics\.jsonl"):
        train(small_config(run, 2, **{"optim.lr": 1e-3}), base_dir=EXAMPLE, log=lambda *a: None)
    assert {n: (run / n).read_bytes() for n in before} == before

    # A crash after the checkpoint of step 1 but after logging step 2: resume redoes step 2.
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "reward_mean": -1.0}) + "\n")
    train(small_config(run, 3, **{"trainer.eval_every": 0, "trainer.resume": "true"}), base_dir=EXAMPLE,
          log=lambda *a: None)
    steps = [m["step"] for m in read_metrics(run)]
    assert steps == [0, 1, 2] and read_metrics(run)[2]["reward_mean"] >= 0

    (run / "checkpoint.pt").unlink()  # a run that died before its first checkpoint
    shutil.rmtree(run / "checkpoints")
    train(small_config(run, 1, **{"trainer.eval_every": 0, "trainer.resume": "true"}), base_dir=EXAMPLE,
          log=lambda *a: None)
    assert [m["step"] for m in read_metrics(run)] == [0]
