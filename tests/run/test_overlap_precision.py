"""trainer.collect overlap (the next step's rollouts are collected while this step's update runs) and
bf16-mixed training precision: what each changes and what it must not."""

from __future__ import annotations

import copy
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from test_train_e2e import read_metrics
from test_train_e2e import small_config as e2e_config

from tracetrain.config import ConfigError, build_config
from tracetrain.learn.logprobs import PRECISIONS, autocast, faster_precision, response_logprobs
from tracetrain.learn.update import ppo_update
from tracetrain.models import tiny
from tracetrain.rows.aggregate import aggregate
from tracetrain.run.trainer import Trainer, train
from tracetrain.types import Rollout, Turn

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "guess"


def small_config(run_dir: Path, steps: int, **extra):
    """test_train_e2e's small run of the guess demo, collecting while it updates."""
    return e2e_config(run_dir, steps, **{"trainer.collect": "overlap", "trainer.max_staleness": 1, **extra})


def turn_versions_of_step(run_dir: Path, step: int) -> set[int]:
    db = sqlite3.connect(run_dir / "traces.db")
    rows = db.execute(
        "SELECT DISTINCT t.model_version FROM turns t JOIN rollouts r ON r.rollout_id = t.rollout_id "
        "WHERE r.group_id LIKE ?", (f"%-s{step}-t%",)).fetchall()
    db.close()
    return {v for (v,) in rows}


@pytest.mark.slow
def test_collect_overlap_is_one_version_behind_overlaps_and_resumes_identically(tmp_path, monkeypatch):
    # Wall-clock intervals of every collect and every update of the run.
    import tracetrain.run.collectors as C
    import tracetrain.run.learner as L

    spans = {"collect": [], "update": []}
    collect_step, update = C.Play.step, L.ppo_update

    async def timed_collect(self, step):
        t = time.perf_counter()
        out = await collect_step(self, step)
        spans["collect"].append((step, t, time.perf_counter()))
        return out

    def timed_update(*a, **k):
        t = time.perf_counter()
        time.sleep(0.3)  # a slow update: the next step's collect must run meanwhile
        out = update(*a, **k)
        spans["update"].append((t, time.perf_counter()))
        return out

    monkeypatch.setattr(C.Play, "step", timed_collect)
    monkeypatch.setattr(L, "ppo_update", timed_update)

    run = tmp_path / "run"
    train(small_config(run, 2), base_dir=EXAMPLE, log=lambda *_: None)
    rows = read_metrics(run)
    assert [m["model_version"] for m in rows] == [1, 2]
    # Step 1's rollouts come from the policy before step 0's update; they are trained, not dropped.
    assert [m["rollout_model_version"] for m in rows] == [0, 0]
    assert turn_versions_of_step(run, 1) == {0}
    assert all(m["n_stale_rollouts"] == 0 and m["aggregate/n_rollouts"] == 12 for m in rows)
    # Step 1's collect ran while step 0's update ran.
    (_, c0, c1), = [s for s in spans["collect"] if s[0] == 1]
    u0, u1 = spans["update"][0]
    assert c0 < u1 and u0 < c1, (spans, "the collect of step 1 did not overlap the update of step 0")
    # the update's idle share of each step: its thread computed (slept 0.3 s) in each, within it
    assert all(0 <= m["time/update_idle_frac"] < 1 for m in rows)

    # Resume two more steps; the same as four straight, bit for bit (every metric but the measured
    # ones, the weights): step 2 is collected from the engine weights the checkpoint kept.
    train(small_config(run, 4, **{"trainer.resume": "true"}), base_dir=EXAMPLE, log=lambda *_: None)
    straight = tmp_path / "straight"
    train(small_config(straight, 4), base_dir=EXAMPLE, log=lambda *_: None)
    a, b = read_metrics(run), read_metrics(straight)
    assert [m["rollout_model_version"] for m in b] == [0, 0, 1, 2]
    assert turn_versions_of_step(straight, 3) == {2}
    measured = ("time/", "memory/", "rollouts_per_s", "trained_tokens_per_s", "engine/idle_frac")
    assert [{k: v for k, v in x.items() if not k.startswith(measured)} for x in a] == \
        [{k: v for k, v in y.items() if not k.startswith(measured)} for y in b]
    wa, wb = (torch.load(r / "checkpoint.pt", weights_only=False)["model"] for r in (run, straight))
    assert all(torch.equal(wa[k], wb[k]) for k in wb)


@pytest.mark.slow
def test_a_run_resumed_without_overlap_shares_the_weights_again(tmp_path):
    """A checkpoint of an overlapping run, resumed with collect step: the engine decodes
    with the policy itself again (every step's rollouts from the current version, all trained)."""
    run = tmp_path / "run"
    train(small_config(run, 2, **{"trainer.eval_every": 0}), base_dir=EXAMPLE, log=lambda *_: None)
    train(small_config(run, 4, **{"trainer.eval_every": 0, "trainer.resume": "true",
                                  "trainer.collect": "step", "trainer.max_staleness": 0}),
          base_dir=EXAMPLE, log=lambda *_: None)
    rows = read_metrics(run)[2:]
    assert [m["rollout_model_version"] for m in rows] == [2, 3]
    assert [m["model_version"] for m in rows] == [3, 4]
    assert all(m["n_stale_rollouts"] == 0 and m["aggregate/n_rollouts"] == 12 for m in rows)
    # collect step: the engine and the update take turns, so neither computes while the other
    # does, and their idle shares of a step add up to at least 1
    assert all(m["engine/idle_frac"] + m["time/update_idle_frac"] >= 0.99 for m in rows), rows


def test_collect_overlap_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"^config key 'trainer.max_staleness': must be >= 1"):
        build_config({}, ["trainer.collect=overlap"])
    with pytest.raises(ConfigError,
                       match=r"^config key 'trainer.collect': 'overlap' is for backend 'embedded'"):
        build_config({}, ["trainer.collect=overlap", "trainer.max_staleness=1", "backend=verl"])
    with pytest.raises(ConfigError, match="trainer.precision"):
        build_config({}, ["trainer.precision=fp16"])
    with pytest.raises(ConfigError, match=r"^config key 'trainer.precision': 'bf16-mixed' is for backend"):
        build_config({}, ["trainer.precision=bf16-mixed", "backend=verl"])
    with pytest.raises(ConfigError, match=r"^config key 'trainer.precision': 'auto' is for backend"):
        build_config({}, ["trainer.precision=auto", "backend=verl"])
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        build_config({}, ["model.attn_implementation=flash"])


def _batch():
    rollouts = [Rollout(f"r{k}", f"g{k // 4}",
                        [Turn([3, 4, 5 + k, 6, 7, 8], [40 + k, 41, 2 + k], [-1.0, -0.5, -0.2])],
                        reward=float(k % 2)) for k in range(8)]
    batch, _ = aggregate(rollouts, max_prompt_length=16, max_response_length=8)
    return batch, torch.tensor([-1.0, 1.0] * 4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bf16_mixed_update_is_close_to_fp32_and_keeps_the_loss_weights(attn):
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
    model.set_attn_implementation(attn)
    batch, adv = _batch()
    out = {}
    for precision in ("fp32", "bf16-mixed"):
        m = copy.deepcopy(model)
        cfg = build_config({}, [f"trainer.precision={precision}", "optim.grad_clip=1e9",
                                "optim.mini_batches=2"])
        res = ppo_update(m, torch.optim.SGD(m.parameters(), lr=0.0), batch, adv, cfg)
        grad = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        out[precision] = (res, grad, [p.dtype for p in m.parameters()])
    (r32, g32, d32), (r16, g16, d16) = out["fp32"], out["bf16-mixed"]
    assert set(d16) == {torch.float32} == set(d32)  # weights and gradients stay fp32
    assert not torch.equal(g16, g32)  # the matmuls really ran in bf16 ...
    cos = torch.nn.functional.cosine_similarity(g16, g32, dim=0)
    assert cos > 0.99, cos  # ... and the update points the same way
    for a, b in zip(r32, r16, strict=True):  # the token weights do not depend on the precision
        assert a.metrics["weight_mass"] == pytest.approx(1.0)
        assert b.metrics["weight_mass"] == pytest.approx(1.0)
        assert b.metrics["rollout_mass_min"] == pytest.approx(a.metrics["rollout_mass_min"])
        assert b.metrics["rollout_mass_max"] == pytest.approx(a.metrics["rollout_mass_max"])


def test_bf16_mixed_logprobs_are_fp32_tensors_close_to_fp32():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
    batch, _ = _batch()
    args = (model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_length)
    with torch.no_grad():
        lp32, _ = response_logprobs(*args)
        lp16, _ = response_logprobs(*args, precision="bf16-mixed")
    mask = batch.response_mask.bool()
    assert lp16.dtype == torch.float32
    diff = (lp16 - lp32)[mask].abs()
    assert 0 < diff.max() < 0.05, diff.max()
    with pytest.raises(ValueError, match="precision"):
        autocast("fp16")


def test_attn_implementation_reaches_the_model(tmp_path):
    cfg = build_config({}, ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
                            "model.num_kv_heads=1", "model.attn_implementation=eager",
                            f"trainer.run_dir={tmp_path}"])
    from tracetrain.agents.tasks import load_task

    trainer = Trainer(cfg, load_task("task.py", EXAMPLE))
    assert trainer.learner.model.config._attn_implementation == "eager"


def _tiny_model():
    tok = tiny.build_tokenizer()
    return tiny.build_model(tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)


def test_faster_precision_measures_both_and_leaves_the_model_as_it_was():
    model = _tiny_model().train()
    params = list(model.parameters())
    params[0].grad = torch.full_like(params[0], 0.5)  # a gradient being accumulated survives
    weights = [p.detach().clone() for p in params]
    rng = torch.get_rng_state()
    choice, seconds = faster_precision(model, tokens=64)
    assert set(seconds) == set(PRECISIONS) and all(0 < s < 60 for s in seconds.values())
    assert choice == ("bf16-mixed" if seconds["bf16-mixed"] <= 0.9 * seconds["fp32"] else "fp32")
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
    assert torch.equal(params[0].grad, torch.full_like(params[0], 0.5))
    assert all(p.grad is None for p in params[1:])
    assert torch.equal(torch.get_rng_state(), rng)  # the run's random stream did not move
    assert model.training


@pytest.mark.parametrize("slow", PRECISIONS)
def test_faster_precision_picks_the_one_that_measures_faster(slow, monkeypatch):
    """A pass that takes 0.2 s under one precision and 0.01 s under the other, on a clock that
    moves only inside the passes (a busy shared machine cannot stall the fast one past the slow
    one, as it once did in CI with real sleeps): the other one is chosen, each timed as it ran."""
    import types

    import tracetrain.learn.logprobs as L

    real, clock = L.response_logprobs, [0.0]

    def timed(*a, precision="fp32", **k):
        clock[0] += 0.2 if precision == slow else 0.01
        return real(*a, precision=precision, **k)

    monkeypatch.setattr(L, "response_logprobs", timed)
    monkeypatch.setattr(L, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    choice, seconds = faster_precision(_tiny_model(), tokens=32)
    fast = next(p for p in PRECISIONS if p != slow)
    assert seconds == {slow: pytest.approx(0.2), fast: pytest.approx(0.01)}
    assert choice == fast


@pytest.mark.slow
def test_auto_precision_is_resolved_once_recorded_and_kept_by_a_resumed_run(tmp_path, monkeypatch):
    import json

    import tracetrain.run.learner as L

    seen, update = [], L.ppo_update

    def spy(*a, **k):
        seen.append(a[4].trainer.precision)  # ppo_update(model, optimizer, batch, adv, cfg, ...)
        return update(*a, **k)

    monkeypatch.setattr(L, "ppo_update", spy)
    import tracetrain.run.precision as P

    monkeypatch.setattr(P, "faster_precision", lambda model: ("bf16-mixed", {"fp32": 2.0, "bf16-mixed": 1.0}))
    run, lines = tmp_path / "run", []
    overrides = {"trainer.eval_every": 0, "trainer.precision": "auto", "trainer.collect": "step",
                 "trainer.max_staleness": 0}
    train(small_config(run, 1, **overrides), base_dir=EXAMPLE, log=lines.append)
    assert seen == ["bf16-mixed"]
    assert any("trainer.precision auto: bf16-mixed" in str(line) for line in lines)
    assert json.loads((run / "config.json").read_text())["trainer"]["precision"] == "bf16-mixed"
    assert torch.load(run / "checkpoint.pt", weights_only=False)["precision"] == "bf16-mixed"

    def refuse(model):
        raise AssertionError("a resumed run measured again")

    monkeypatch.setattr(P, "faster_precision", refuse)
    train(small_config(run, 2, **overrides, **{"trainer.resume": "true"}), base_dir=EXAMPLE,
          log=lambda *_: None)
    assert seen == ["bf16-mixed", "bf16-mixed"]
