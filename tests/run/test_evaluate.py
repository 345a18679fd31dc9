"""`tracetrain eval`: pass@k against hand-computed cases, a saved policy/ evaluates as the
checkpoint it came from, failures are counted apart, the command's output."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_engine_vllm import IN_PROCESS_KEY, TOL
from test_engine_vllm import vllm_python as vllm_python  # the fixture: the vLLM interpreter
from view_run import TESTS, make_run

from tracetrain.agents.tasks import load_task
from tracetrain.config import build_config
from tracetrain.run.evaluate import evaluate, pass_at_k


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


@given(n=st.integers(1, 30), data=st.data())
def test_pass_at_k_is_the_chance_a_draw_of_k_holds_a_success(n, data):
    c = data.draw(st.integers(0, n))
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert values[0] == pytest.approx(c / n)
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:], strict=False))  # grows with k
    # against the complement counted directly: draws of k failures among all draws of k
    k = data.draw(st.integers(1, n))
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def guess_config(run: Path, steps: int = 2, extra: list[str] = ()):
    small = [] if any(k.startswith("model.") for k in extra) else [
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1"]
    return build_config({"task_args": {"high": 4, "max_turns": 3}}, [
        "task=task.py", *small, *extra, "warm_start.steps=3", "warm_start.batch_size=8",
        "rollout.tasks_per_step=3", "rollout.n_per_task=4", "optim.lr=1e-2", "optim.warmup_steps=0",
        f"trainer.steps={steps}", f"trainer.run_dir={run}", "trainer.seed=3", "trainer.eval_tasks=6"])


@pytest.mark.slow
def test_a_saved_policy_evaluates_as_its_checkpoint(tmp_path):
    from tracetrain.run.trainer import train

    guess = Path(__file__).resolve().parents[2] / "examples" / "guess"
    run = tmp_path / "run"
    cfg = guess_config(run)
    train(cfg, base_dir=guess, log=lambda *_: None)
    task = load_task("task.py", guess)
    out = {}
    for name, policy in (("policy", run / "policy"), ("checkpoint", run / "checkpoint.pt"),
                         ("untrained", None)):
        out[name] = asyncio.run(evaluate(cfg, task, None, policy=policy, k=3, temperature=1.0))
    (a, rows_a), (b, rows_b) = out["policy"], out["checkpoint"]
    assert [r["rewards"] for r in rows_a] == [r["rewards"] for r in rows_b]
    assert a["pass@1"] == b["pass@1"] and a["pass@3"] == b["pass@3"]
    assert a["tasks"] == 6 and a["tries"] == 18 and a["failed"] == 0
    for r in rows_a:  # each task's figures from its own tries
        assert r["pass@1"] == pytest.approx(r["successes"] / len(r["rewards"]))
    assert out["untrained"][0]["policy"] == "untrained"


def test_failed_tries_are_counted_apart_and_the_command_writes_each_task(tmp_path, capsys):
    from tracetrain.cli import main

    run = make_run(tmp_path / "run", steps=1)
    cfg_path = run / "config.json"  # the run's own config names the task relative to tests/
    cfg_path.write_text(cfg_path.read_text().replace('"view_task.py"',
                                                     json.dumps(str(TESTS / "view_task.py"))))
    assert main(["eval", str(cfg_path), "--policy", str(run / "checkpoint.pt"), "--k", "2", "--tasks", "4",
                 "--success", "0.5", "--out", str(tmp_path / "eval.jsonl")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and summary["tries"] == 8
    failing = [r for r in rows if r["task"]["kind"] == "fail"]
    assert failing and all(r["failed"] == 2 and r["rewards"] == [] and r["pass@1"] is None for r in failing)
    assert summary["failed"] == 2 * len(failing)
    scored = [x for r in rows for x in r["rewards"]]
    assert summary["reward_mean"] == pytest.approx(sum(scored) / len(scored))
    assert main(["eval", str(cfg_path), "--policy", str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_on_vllm_plays_the_policy_as_the_local_engine_does(tmp_path, vllm_python):
    """Greedy tries on a real vLLM server launched on a saved policy/ score each task as the local
    engine's greedy tries do, and vLLM's logprobs are the policy's."""
    from tracetrain.run.trainer import train

    guess = Path(__file__).resolve().parents[2] / "examples" / "guess"
    run = tmp_path / "run"
    cfg = guess_config(run, extra=["model.num_layers=2"])  # the tiny model's head size: vLLM's CPU
    train(cfg, base_dir=guess, log=lambda *_: None)      # attention has no kernel for 16
    task = load_task("task.py", guess)
    (tmp_path / "local").mkdir()
    local, rows_local = asyncio.run(evaluate(cfg, task, None, policy=run / "policy", k=2,
                                             temperature=0.0, store_dir=tmp_path / "local"))
    on_vllm = build_config(json.loads((run / "config.json").read_text()),
                           ["engine.kind=vllm", f"engine.python={vllm_python}", "rollout.timeout_s=120",
                            IN_PROCESS_KEY])
    kept = tmp_path / "kept"
    kept.mkdir()
    summary, rows = asyncio.run(evaluate(on_vllm, task, None, policy=run / "policy", k=2,
                                         temperature=0.0, store_dir=kept, log=lambda *_: None))
    assert summary["failed"] == 0 and summary["tries"] == local["tries"] == 12
    assert [r["rewards"] for r in rows] == [r["rewards"] for r in rows_local]
    assert summary["pass@1"] == local["pass@1"]
    # every turn vLLM answered carries logprobs the policy itself gives its tokens
    from tracetrain.run.evaluate import load_eval_policy
    from tracetrain.store import SQLiteStore

    model, _ = load_eval_policy(cfg, run / "policy")
    def turns_in(d: Path):
        with SQLiteStore(d / "eval_traces.db", read_only=True) as store:
            return [t for r in store.load_rollouts() for t in r.turns]

    turns = turns_in(kept)
    assert len(turns) >= 12  # greedy: the same tokens, turn for turn
    assert sorted(tuple(t.response_ids) for t in turns) == sorted(
        tuple(t.response_ids) for t in turns_in(tmp_path / "local"))
    for t in turns[:20]:
        ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(t.prompt_ids) - 1:-1].float()
        mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(t.response_ids)[:, None])[:, 0]
        assert (mine - torch.tensor(list(t.response_logprobs))).abs().max() < TOL
