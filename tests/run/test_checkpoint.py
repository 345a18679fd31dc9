"""A run's checkpoint (tracetrain/run/checkpoint.py): what a resumed run rebuilds from it is what
a fresh run builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracetrain.agents.tasks import load_task
from tracetrain.config import build_config
from tracetrain.models import lora
from tracetrain.run import checkpoint
from tracetrain.run.trainer import Trainer

TESTS = Path(__file__).resolve().parents[1] / "support"
LORA = ["model.lora.r=4", 'model.lora.target_modules=["q_proj", "v_proj"]', "model.lora.dropout=0.1"]


def trainer(run: Path, *extra: str) -> Trainer:
    cfg = build_config({}, ["task=continuous_task.py", "model.hidden_size=32", "model.num_layers=2",
                            "model.num_heads=2", "model.num_kv_heads=1", "loss.kl_coef=0.1",
                            f"trainer.run_dir={run}", *extra])
    return Trainer(cfg, load_task("continuous_task.py", TESTS))


@pytest.mark.parametrize("extra", [[], LORA], ids=["full", "lora"])
def test_a_resumed_runs_reference_model_is_a_fresh_runs(tmp_path, extra):
    """The KL reference of a run resumed from a checkpoint equals the fresh run's: every module's
    training flag (under LoRA peft leaves the adapter's dropout in training mode), every
    parameter's requires_grad, and the weights (the reference's, not the policy's since)."""
    fresh = trainer(tmp_path, *extra)
    fresh.learner.start_reference()
    with torch.no_grad():  # an update: the policy moves, its reference does not
        for p in lora.trainable(fresh.learner.model):
            p.add_(0.5)
    path = checkpoint.save(tmp_path / "checkpoint.pt", fresh.state, fresh.learner, fresh.sync)

    resumed = trainer(tmp_path, *extra)
    checkpoint.restore(path, resumed.learner, resumed.sync)
    resumed.learner.start_reference()  # (what run() calls: the restored reference is kept)
    a, b = fresh.learner.ref_model, resumed.learner.ref_model
    assert a is not None and b is not None
    mode = {n: m.training for n, m in a.named_modules()}
    assert not any(mode.values())
    assert {n: m.training for n, m in b.named_modules()} == mode
    grads = {n: p.requires_grad for n, p in a.named_parameters()}
    assert grads and not any(grads.values())
    assert {n: p.requires_grad for n, p in b.named_parameters()} == grads
    sa, sb, policy = a.state_dict(), b.state_dict(), resumed.learner.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sb[k], policy[k]) for k in sb)  # the reference, not the policy
