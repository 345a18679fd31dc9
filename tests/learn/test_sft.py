"""`tracetrain sft`: which rollouts are chosen, duplicates trained once, the rows are the RL path's
with the policy's own response ids as the trained tokens, the loss falls, and an RL run starts
from the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tracetrain.config import build_config
from tracetrain.learn.sft import dedupe, select, sft_rows
from tracetrain.types import Rollout, Turn


def rollout(rid: str, group: str, reward, state="succeeded", turns=2, base=10) -> Rollout:
    prompt, made = [1, 2, base], []
    for k in range(turns):
        response = [base + 20 + k, base + 21 + k, 3]
        made.append(Turn(list(prompt), response, [-0.1] * 3, 0))
        prompt = prompt + response + [4, base + k]  # the next prompt extends this one
    return Rollout(rid, group, made, reward, state)


def test_choosing_by_reward_and_best_per_group():
    rs = [rollout("a", "g1", 1.0), rollout("b", "g1", 0.0), rollout("c", "g1", 1.0),
          rollout("d", "g1", 0.5), rollout("e", "g2", 0.0), rollout("f", "g2", 0.0),
          rollout("x", "g2", None, state="failed")]
    assert [r.rollout_id for r in select(rs, min_reward=1.0)] == ["a", "c"]
    assert [r.rollout_id for r in select(rs, best_per_group=1)] == ["a", "e"]
    assert [r.rollout_id for r in select(rs, best_per_group=2)] == ["a", "c", "e", "f"]
    assert [r.rollout_id for r in select(rs, min_reward=0.5, best_per_group=2)] == ["a", "c"]
    with pytest.raises(ValueError):
        select(rs)
    later = rollout("v", "g3", 1.0)
    later.turns[1].model_version = 2  # a turn made after two updates
    assert [r.rollout_id for r in select([*rs, later], min_reward=1.0, max_version=0)] == ["a", "c"]
    assert [r.rollout_id for r in select([*rs, later], min_reward=1.0, max_version=2)] == ["a", "c", "v"]


def test_duplicates_are_trained_once_and_rows_train_the_policys_own_tokens():
    a, same = rollout("a", "g1", 1.0, base=10), rollout("a2", "g9", 1.0, base=10)
    b = rollout("b", "g2", 1.0, base=40, turns=3)
    unique = dedupe([a, same, b])
    assert [r.rollout_id for r in unique] == ["a", "b"]
    cfg = build_config({}, [])
    batch = sft_rows(unique, cfg, pad_token_id=0)
    for k, r in enumerate(unique):
        (i,) = (batch.rollout_index == k).nonzero().squeeze(1).tolist()  # one row: prefixes held
        trained = batch.responses[i][batch.response_mask[i]].tolist()
        assert trained == [x for t in r.turns for x in t.response_ids]
        forward = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
        last = r.turns[-1]
        assert forward == list(last.prompt_ids) + list(last.response_ids)  # exactly the ids seen


@pytest.mark.slow
def test_sft_from_a_run_then_rl_from_its_policy(tmp_path, capsys):
    from test_evaluate import guess_config
    from transformers import AutoModelForCausalLM

    from tracetrain.cli import main
    from tracetrain.run.trainer import Trainer, train

    guess = Path(__file__).resolve().parents[2] / "examples" / "guess"
    run = tmp_path / "run"
    train(guess_config(run), base_dir=guess, log=lambda *_: None)
    out = tmp_path / "sft"
    assert main(["sft", str(run / "config.json"), "--from", str(run), str(run), "--best-per-group", "1",
                 "--epochs", "4", "--lr", "3e-3", "--out", str(out)]) == 0
    report = json.loads((out / "sft.json").read_text())
    assert report["chosen"] == 2 * report["trained_rollouts"]  # the run named twice: each once
    assert report["trained_rollouts"] == 2 * 3  # 2 steps x 3 groups, the best of each
    assert report["epoch_losses"][-1] < report["epoch_losses"][0]
    # an RL run starts from the result: its policy is the SFT output, and it trains
    cfg = build_config(json.loads((run / "config.json").read_text()),
                       ["model.kind=pretrained", f"model.path={out / 'policy'}",
                        f"trainer.run_dir={tmp_path / 'rl'}", "trainer.steps=1", "warm_start.steps=0"])
    start = Trainer(cfg, None, log=lambda *_: None).learner.model.state_dict()
    saved = AutoModelForCausalLM.from_pretrained(out / "policy").state_dict()
    assert all(torch.equal(start[k], saved[k]) for k in saved)
    rl = train(cfg, base_dir=guess, log=lambda *_: None)
    assert rl["steps"] == 1


@pytest.mark.slow
def test_sft_under_lora_trains_the_adapter_alone_and_its_checkpoint_evaluates_as_its_policy(tmp_path, capsys):
    import asyncio

    from test_evaluate import guess_config

    from tracetrain.agents.tasks import load_task
    from tracetrain.cli import main
    from tracetrain.models.load import load_policy
    from tracetrain.run.evaluate import evaluate
    from tracetrain.run.trainer import Trainer, train

    guess = Path(__file__).resolve().parents[2] / "examples" / "guess"
    lora_keys = ["model.lora.r=4", 'model.lora.target_modules=["q_proj", "v_proj"]']
    run = tmp_path / "run"
    train(guess_config(run, extra=lora_keys), base_dir=guess, log=lambda *_: None)
    out = tmp_path / "sft"
    assert main(["sft", str(run / "config.json"), "--from", str(run), "--best-per-group", "1",
                 "--epochs", "4", "--lr", "3e-2", "--out", str(out)]) == 0
    report = json.loads((out / "sft.json").read_text())
    assert report["epoch_losses"][-1] < report["epoch_losses"][0]
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ck["kind"] == "weights" and ck["model"] and all("lora_" in k for k in ck["model"])
    cfg = build_config(json.loads((run / "config.json").read_text()), [])
    base, _ = load_policy(cfg.model, seed=cfg.trainer.seed)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "policy").state_dict()
    before = base.state_dict()
    moved = {k for k in merged if not torch.equal(merged[k], before[k])}
    assert moved and all(("q_proj" in k or "v_proj" in k) for k in moved)  # only the adapted layers
    # the weights-only checkpoint plays as the merged policy/ beside it (greedy)
    task = load_task("task.py", guess)
    from tracetrain.store import SQLiteStore

    answers = {}
    for name in ("checkpoint.pt", "policy"):
        (tmp_path / name).mkdir()
        summary, rows = asyncio.run(evaluate(cfg, task, None, policy=out / name, k=1, temperature=0.0,
                                             store_dir=tmp_path / name))
        with SQLiteStore(tmp_path / name / "eval_traces.db", read_only=True) as store:
            answers[name] = sorted(tuple(t.response_ids) for r in store.load_rollouts() for t in r.turns)
        assert summary["failed"] == 0 and len(answers[name]) >= summary["tries"]
    assert answers["checkpoint.pt"] == answers["policy"]
    # a run cannot resume from it, and says what to do instead
    tr = Trainer(build_config(json.loads((run / "config.json").read_text()), [f"trainer.run_dir={out}"]),
                 None, log=lambda *_: None)
    with pytest.raises(Exception, match="weights-only checkpoint.*model.path"):
        tr.load_checkpoint()
