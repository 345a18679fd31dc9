"""Several policies where a policy is a whole model of its own (`policies.<p>.lora: null`: a copy
of the run's model as RL starts; `policies.<p>.model`: one loaded): served by a local engine of
its own, trained whole from its roles' tokens only, checkpointed and exported beside the adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_several_policies import SUPPORT, TINY, adapters, config, run, without_times

from tracetrain.config import ConfigError, build_config
from tracetrain.models import lora
from tracetrain.run import checkpoint, durable
from tracetrain.run.trainer import Trainer

MIXED = {"solver": {"roles": ["solver"], "lora": {"r": 4, "alpha": 8}},
         "checker": {"roles": ["checker"], "lora": None, "lr": 1e-3}}


def whole(run_dir: Path) -> dict:
    return checkpoint.load(run_dir / "checkpoint.pt")["whole"]


def base_state(cfg) -> dict:
    """The run's model as it starts (the same seed: the same weights), without adapters."""
    return {k: v.clone() for k, v in lora.base(Trainer(cfg, None).learner.model).state_dict().items()}


def moved(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policies, extra, key", [
    ({"c1": {"roles": ["x"], "model": {"hidden_size": 32}, "lora": {"r": 2}}}, [], "policies.c1.lora"),
    ({"c1": {"roles": ["x"], "model": {"hidden_size": 32, "lora": {"r": 2}}}}, [], "policies.c1.model.lora"),
    ({"c1": {"roles": ["x"], "lora": None}}, ["engine.kind=vllm", "engine.python=/usr/bin/python3"],
     "policies.c1"),
    ({"c1": {"roles": ["x"], "lora": None}}, ["trainer.collect=overlap", "trainer.max_staleness=1"],
     "policies.c1"),
    ({"c1": {"roles": ["x"], "lora": None}}, ["trainer.collect=continuous", "trainer.max_staleness=1"],
     "policies.c1"),
])
def test_what_a_whole_model_policy_cannot_run_with_is_refused_naming_the_key(policies, extra, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        build_config({"policies": policies}, extra)


def test_a_whole_model_policy_trains_its_own_copy_beside_an_adapter(tmp_path):
    """The checker a whole copy of the run's model, the solver an adapter: after 3 steps the
    checker's model moved (every weight it has may), the solver's adapter moved, the run's base
    weights did not; the checker's engine decoded with its model (logprob gap of float noise,
    so its turns are its own model's), with its KL reference; policy/checker/ is its model."""
    cfg = config(tmp_path / "run", "loss.kl_coef=0.1", policies=MIXED)
    start = base_state(cfg)
    ms = run(cfg)
    end_whole, end_adapters = whole(tmp_path / "run")["checker"], adapters(tmp_path / "run")
    assert moved(start, end_whole)
    assert sorted(end_adapters) == ["solver"] and any(v.abs().max() > 0 for k, v in
                                                      end_adapters["solver"].items() if "lora_B" in k)
    trainer = Trainer(cfg, None)
    checkpoint.restore(tmp_path / "run" / "checkpoint.pt", trainer.learner, trainer.sync)
    assert not moved(start, lora.base(trainer.learner.model).state_dict())  # the base: frozen
    # its reference: as it started
    assert not moved(start, trainer.learner.whole_refs["checker"].state_dict())
    for m in ms:
        assert m["policy/checker/engine/logprob_gap_max"] < 1e-4
        assert m["policy/solver/engine/logprob_gap_max"] < 1e-4
        assert m["policy/checker/loss/rollout_mass_x_R_max"] == pytest.approx(1.0, abs=1e-6)
        assert m["policy/checker/aggregate/tokens/trained"] == m["roles/checker/response_tokens"]
        assert m["policy/checker/lr"] == pytest.approx(1e-3)
    assert ms[-1]["policy/checker/loss/kl_ref"] > 0  # against its own reference, which it left
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy" / "checker").state_dict()
    assert all(torch.equal(exported[k], v) for k, v in end_whole.items() if k in exported)
    assert (tmp_path / "run" / "policy" / "solver" / "adapter" / "adapter_config.json").is_file()


def test_a_whole_model_policy_of_no_trained_call_keeps_its_weights_bit_for_bit(tmp_path):
    """Isolation: roles.train [solver], the checker a whole model: its weights after 3 steps are
    the ones it started with, bit for bit."""
    cfg = config(tmp_path / "run", "roles.train=[solver]", policies=MIXED)
    start = base_state(cfg)
    ms = run(cfg)
    assert not moved(start, whole(tmp_path / "run")["checker"])
    assert all("policy/checker/loss" not in m and "policy/solver/loss" in m for m in ms)


def test_one_whole_model_policy_holding_every_role_is_the_run_without_policies(tmp_path):
    """Reduction: one whole-model policy of every trained role (served by its own engine, a copy
    of the run's model) equals the run without `policies`: the same metrics step by step and the
    same weights, bit for bit."""
    a = run(config(tmp_path / "a", policies={"p": {"roles": ["solver", "checker"], "lora": None}}))
    b = run(config(tmp_path / "b", policies=None))
    a = [{k: v for k, v in m.items() if not k.startswith(("policy/", "engine/"))} for m in without_times(a)]
    b = [{k: v for k, v in m.items() if not k.startswith("engine/")} for m in without_times(b)]
    assert a == b
    wa, wb = whole(tmp_path / "a")["p"], checkpoint.load(tmp_path / "b" / "checkpoint.pt")["model"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_resumed_run_with_a_whole_model_policy_is_the_uninterrupted_one(tmp_path):
    """Checkpoints hold the whole model, its optimizer, schedule and KL reference: a run resumed
    from step 1's checkpoint ends as the straight run does (metrics but the times, weights bit for bit)."""
    extra = ("loss.kl_coef=0.1",)
    straight = run(config(tmp_path / "a", *extra, policies=MIXED))
    cut = tmp_path / "b"
    keep = ("trainer.checkpoint_every=1", "trainer.keep_checkpoints=5")
    run(config(cut, *extra, *keep, policies=MIXED))
    for later in (cut / "checkpoints").glob("step-00000[23].pt*"):
        later.unlink()
    resumed = run(config(cut, *extra, *keep, "trainer.resume=true", policies=MIXED))
    assert durable.newest_valid(cut)[0].name == "step-000003.pt"
    assert without_times(resumed) == without_times(straight)
    wa, wb = whole(tmp_path / "a")["checker"], whole(cut)["checker"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_policy_of_its_own_model_trains_that_model(tmp_path):
    """`policies.checker.model`: a model of another size (the run's tokenizer) serves and learns
    the checker's calls; policy/checker/ is that model."""
    own = {"kind": "tiny", "hidden_size": 48, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    cfg = config(tmp_path / "run", policies={**MIXED, "checker": {"roles": ["checker"], "model": own}})
    assert cfg.policies["checker"].lora is None  # `model` alone: the model whole
    ms = run(cfg)
    assert all(m["policy/checker/engine/logprob_gap_max"] < 1e-4 for m in ms)
    state = whole(tmp_path / "run")["checker"]
    assert state["model.embed_tokens.weight"].shape[1] == 48
    exported = json.loads((tmp_path / "run" / "policy" / "checker" / "config.json").read_text())
    assert exported["hidden_size"] == 48 and exported["num_hidden_layers"] == 1


def test_continuous_collection_trains_the_whole_model_policy_each_group_once(tmp_path):
    """trainer.collect continuous (max_staleness 0, the local engines held through each update):
    both policies train every step's groups, each rollout 1/R_p in each, no group twice, every
    rollout of the version it is trained at."""
    ms = run(config(tmp_path / "run", "trainer.collect=continuous", "trainer.max_staleness=0",
                    "trainer.steps=4", policies=MIXED))
    groups = [g for m in ms for g in m["collect/groups"]]
    assert len(groups) == len(set(groups)) == 4 * 2
    for m in ms:
        for p in ("solver", "checker"):
            assert m[f"policy/{p}/loss/rollout_mass_x_R_max"] == pytest.approx(1.0, abs=1e-6)
            assert m[f"policy/{p}/engine/logprob_gap_max"] < 1e-4
        assert set(k for k in m if k.startswith("staleness/rollouts_")) == {"staleness/rollouts_0"}
    assert moved(base_state(config(tmp_path / "x", policies=MIXED)), whole(tmp_path / "run")["checker"])


def test_sft_and_eval_take_a_whole_model_policy(tmp_path, capsys):
    """`tracetrain sft` with an adapter and a whole-model policy fine-tunes the adapter and the
    whole model each on its own roles' tokens (policy/<p>/ each; the weights-only checkpoint holds
    both); `tracetrain eval --policy` of that checkpoint, and of the run's, serves each role by its
    policy (no failed try); a checkpoint without the config's whole-model policies is refused."""
    import yaml

    from tracetrain.cli import main
    from tracetrain.run.evaluate import load_eval_whole

    run(config(tmp_path / "run", "trainer.steps=1", policies=MIXED))
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "task": str(SUPPORT / "two_roles_task.py"), "policies": MIXED,
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1},
        "rollout": {"max_tokens": 5, "agent_workers": 0}, "trainer": {"seed": 3}}))
    cfg = build_config(yaml.safe_load(cfg_file.read_text()), [f"trainer.run_dir={tmp_path / 'x'}"])
    start = base_state(cfg)
    assert main(["sft", str(cfg_file), "--from", str(tmp_path / "run"), "--min-reward", "0",
                 "--epochs", "1", "--lr", "1e-2", "--out", str(tmp_path / "sft")]) == 0
    report = json.loads((tmp_path / "sft" / "sft.json").read_text())
    assert sorted(report["epoch_losses"]) == ["checker", "solver"]
    tuned = torch.load(tmp_path / "sft" / "checkpoint.pt", weights_only=False)
    assert moved(start, tuned["whole"]["checker"]) and sorted(tuned["model"]) == ["solver"]
    assert (tmp_path / "sft" / "policy" / "checker" / "config.json").is_file()
    assert (tmp_path / "sft" / "policy" / "solver" / "adapter" / "adapter_config.json").is_file()
    loaded = load_eval_whole(cfg, tmp_path / "sft" / "checkpoint.pt")["checker"].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in tuned["whole"]["checker"].items())
    for policy in (tmp_path / "sft" / "checkpoint.pt", tmp_path / "run" / "checkpoint.pt"):
        capsys.readouterr()
        assert main(["eval", str(cfg_file), "--policy", str(policy), "--k", "1", "--tasks", "2"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["failed"] == 0 and summary["tries"] == 2
    more = build_config({"policies": {**MIXED, "extra": {"roles": ["z"], "lora": None}}},
                        ["task=x.py", *TINY])
    with pytest.raises(ConfigError, match=r"whole-model policies \['checker'\]; "
                                          r"this config's are \['checker', 'extra'\]"):
        load_eval_whole(more, tmp_path / "run" / "checkpoint.pt")
