"""Fail fast (run/failures.py, trainer.max_failed_steps): a run whose every rollout fails stops at
that step with the first failed rollout's error, keeps the checkpoint of its last completed step
and none of the failed one, and summary.json and `tracetrain train`'s exit status say why; a run
with some failures, or with fewer failed steps in a row than the limit, goes on. Runs of the guess
demo with agents that fail for real reasons (tests/support/failing_guess.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tracetrain.cli import main
from tracetrain.config import load_config
from tracetrain.run.failures import FailedSteps, error_line, first_error
from tracetrain.run.trainer import train
from tracetrain.types import RunFailed

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "guess" / "config.yaml"
FAILING = ROOT / "tests" / "support" / "failing_guess.py"
SHORT = ["trainer.steps=3", "warm_start.steps=0", "rollout.tasks_per_step=2", "rollout.n_per_task=2",
         "trainer.eval_every=0"]
# what the engine answers a call whose max_tokens does not fit the tiny model's 2048-token context
REFUSED = re.compile(r"openai\.BadRequestError: Error code: 400 - prompt \(\d+ tokens\) \+ "
                     r"max_tokens \(\d+\) exceeds the context limit of 2048 tokens")


def config(run: Path, agent: str, *extra: str):
    return load_config(DEMO, [*SHORT, "rollout.agent_workers=0", f"task={FAILING}", f"agent={agent}",
                              f"trainer.run_dir={run}", *extra])


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_a_run_whose_every_rollout_fails_stops_at_step_0_with_the_engines_error(tmp_path):
    """The demo as a user runs it (its agent workers, overlap collection), every model call
    refused by the engine: exit 1 with the engine's message in one line, no checkpoint."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tracetrain", "train", str(DEMO), *SHORT,
                           "rollout.max_tokens=5000", f"trainer.run_dir={run}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tracetrain train: error: every rollout of step 0 failed (4 failed): ")
    assert REFUSED.search(last) and "Traceback" not in proc.stderr
    assert re.search(r"step +0 \| fail 4\+0 \| stopped: every rollout of step 0 failed", proc.stdout)
    s = summary(run)
    assert s["steps"] == 0 and s["failed_rollouts"] == 4
    assert s["stopped"].startswith("every rollout of step 0 failed") and REFUSED.search(s["stopped"])
    assert not (run / "checkpoint.pt").exists() and not (run / "policy").exists()
    assert not any((run / "checkpoints").glob("*")) and metrics(run) == []


@pytest.mark.parametrize("collect", [
    ["trainer.collect=step", "trainer.max_staleness=0"],
    ["trainer.collect=overlap", "trainer.max_staleness=1"],
    # (staleness 0: a step takes its own groups, so step 1's failures stay in step 1)
    ["trainer.collect=continuous", "trainer.max_staleness=0"],
], ids=["step", "overlap", "continuous"])
def test_every_collector_stops_at_the_failed_step_keeping_the_last_completed_one(tmp_path, collect):
    """Steps from 1 on fail (a tool server that is not there): step 0 trains, step 1 stops the
    run; the checkpoint is step 0's end (the next step 1), summary.json says why."""
    run = tmp_path / "run"
    with pytest.raises(RunFailed, match=r"^every rollout of step 1 failed \(4 failed\): "
                                        r"httpx\.ConnectError: "):
        train(config(run, "late_tool_down_agent", *collect), base_dir=DEMO.parent,
              log=lambda *_: None)
    ms = metrics(run)
    assert [m["step"] for m in ms] == [0] and ms[0]["n_failed"] == 0 and "loss" in ms[0]
    saved = torch.load(run / "checkpoint.pt", weights_only=False)
    assert saved["step"] == 1 and len(saved["history"]) == 1
    s = summary(run)
    assert s["steps"] == 1 and s["failed_rollouts"] == 4
    assert s["stopped"].startswith("every rollout of step 1 failed (4 failed): httpx.ConnectError")


def test_a_run_with_some_failed_rollouts_completes_every_step(tmp_path):
    run = tmp_path / "run"
    train(config(run, "tool_down_agent"), base_dir=DEMO.parent, log=lambda *_: None)
    ms = metrics(run)
    assert [m["step"] for m in ms] == [0, 1, 2] and all(m["n_failed"] == 2 for m in ms)
    s = summary(run)
    assert s["steps"] == 3 and s["failed_rollouts"] == 6 and "stopped" not in s
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 3


@pytest.mark.parametrize("limit, stops", [(1, True), (2, False), (0, False)])
def test_max_failed_steps_counts_failed_steps_in_a_row(tmp_path, limit, stops):
    """Only step 0 fails (the engine refuses its calls): the default limit stops there, with no
    checkpoint; 2 (two in a row) and 0 (never) go on and train every step."""
    run = tmp_path / "run"
    cfg = config(run, "first_step_agent", f"trainer.max_failed_steps={limit}")
    if stops:
        with pytest.raises(RunFailed, match=r"^every rollout of step 0 failed \(4 failed\): ") as e:
            train(cfg, base_dir=DEMO.parent, log=lambda *_: None)
        assert REFUSED.search(str(e.value))
        assert not (run / "checkpoint.pt").exists() and metrics(run) == []
        assert summary(run)["stopped"] == str(e.value)
        return
    train(cfg, base_dir=DEMO.parent, log=lambda *_: None)
    ms = metrics(run)
    assert [m["n_failed"] for m in ms] == [4, 0, 0] and "loss" not in ms[0] and "loss" in ms[1]
    assert "stopped" not in summary(run)


def test_an_eval_whose_every_try_fails_says_so(tmp_path, capsys):
    assert main(["eval", str(DEMO), "--k", "1", "--tasks", "2", "rollout.agent_workers=0",
                 "rollout.max_tokens=5000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tracetrain eval: error: every eval rollout failed (2 failed): ")
    assert REFUSED.search(err)


def rollouts(*states: str) -> list:
    """Rollouts in `states`; the k-th one's error a traceback ending in `ValueError: boom<k>`."""
    return [SimpleNamespace(state=s, error=None if s == "succeeded" else
                            f"Traceback (most recent call last):\n  File x\nValueError: boom{k}\n")
            for k, s in enumerate(states)]


def test_failed_steps_in_a_row_and_the_first_error():
    f = FailedSteps(2)
    assert f.see(0, rollouts("failed", "timed_out")) is None  # the first of two
    assert f.see(1, []) is None  # an empty take counts neither way
    reason = f.see(2, rollouts("timed_out", "failed"))
    # the error: the streak's first step's first failed rollout's
    assert reason == ("every rollout of steps 0..2 failed (2 steps in a row, trainer.max_failed_steps "
                      "2); the first error: ValueError: boom0")
    assert f.stop_counts == {"failed": 1, "timed_out": 1}
    g = FailedSteps(2)
    g.see(0, rollouts("failed"))
    assert g.see(1, rollouts("failed", "succeeded")) is None  # a success ends the streak
    assert g.see(2, rollouts("failed")) is None
    assert FailedSteps(0).see(0, rollouts("failed")) is None  # 0: never
    assert first_error(rollouts("succeeded", "timed_out", "failed")) == "ValueError: boom2"
    assert error_line("x" * 600).endswith("...") and len(error_line("x" * 600)) == 500
    assert error_line(None) == error_line("  \n") == "(no error recorded)"


def test_a_model_the_engine_cannot_serve_stops_the_run_before_any_rollout(tmp_path):
    """A recurrent model (rwkv: its forward keeps no KV cache) named by a run: `tracetrain train`
    says so in one line naming the key and the model_type, status 2, before any rollout."""
    import transformers as tf

    from tracetrain.models.tiny import build_tokenizer

    tok, folder, run = build_tokenizer(), tmp_path / "rwkv", tmp_path / "run"
    tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                     attention_hidden_size=32, intermediate_size=64)).save_pretrained(folder)
    tok.save_pretrained(folder)
    done = subprocess.run([sys.executable, "-m", "tracetrain", "train", str(DEMO), *SHORT,
                           "model.kind=pretrained", f"model.path={folder}", f"trainer.run_dir={run}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "tracetrain train: error: config key 'model': the local engine cannot serve model_type 'rwkv'")
    assert "Traceback" not in done.stderr and metrics(run) == []
