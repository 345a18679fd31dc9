"""The verl side of `tracetrain train --backend verl`, as far as it runs without GPUs: the verl
config built from a tracetrain config (verl's own Hydra config, checked by verl's dataclasses and
verl's validate_config), verl's trainer object before its workers start, and the rollout plan."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from tiny_model import tiny_causal_lm
from verl.trainer.ppo.ray_trainer import Role
from verl.utils.config import omega_conf_to_dataclass
from verl_cpu import training_batch

from tracetrain.config import ConfigError, TrainConfig, build_config
from tracetrain.integrations.verl.config import LOSS_MODULE, VerlConfig, build_verl_config
from tracetrain.integrations.verl.trainer import make_trainer, verl_workers
from tracetrain.objective.loss import policy_loss
from tracetrain.objective.weights import token_weights
from tracetrain.run.step import rollout_specs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "guess" / "verl.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tracetrain.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    tiny_causal_lm(seed=0).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def tracetrain_config(model_dir: str, **sections) -> TrainConfig:
    return build_config({"model": {"kind": "pretrained", "path": model_dir}, **sections})


def test_loss_settings_reach_verls_actor_and_our_loss(model_dir):
    """clip range, dual clip (off), KL and entropy of the tracetrain config arrive in verl's
    ActorConfig; our registered loss, reading that ActorConfig, computes tracetrain's loss."""
    cfg = tracetrain_config(
        model_dir,
        loss={
            "mode": "seq-mean-token-mean",
            "clip_low": 0.1,
            "clip_high": 0.3,
            "dual_clip": None,
            "kl_coef": 0.02,
            "kl_estimator": "k2",
            "entropy_coef": 0.0,
        },
    )
    conf = build_verl_config(cfg)
    actor = omega_conf_to_dataclass(conf.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == "seq-mean-token-mean"
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.1, 0.3)
    assert math.isinf(actor.clip_ratio_c)
    assert actor.use_kl_loss and actor.kl_loss_coef == 0.02 and actor.kl_loss_type == "k2"
    assert conf.actor_rollout_ref.model.external_lib == LOSS_MODULE
    assert actor.shuffle is False and actor.use_dynamic_bsz is True

    # The loss those settings give: no dual clip, clip range (0.1, 0.3).
    from tracetrain.integrations.verl.loss import weighted_policy_loss

    batch, _, adv, _ = training_batch([2, 1, 3], seed=2)
    mask, old = batch.response_mask, batch.rollout_logprobs
    lp = old + 2.0 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0))
    a = -adv.abs()[batch.rollout_index][:, None].expand(mask.shape)  # A < 0: dual clip can bind
    w = token_weights(mask, batch.rollout_index, mode="seq-mean-token-mean")
    plain = omega_conf_to_dataclass(
        build_verl_config(
            tracetrain_config(
                model_dir, loss={"clip_low": 0.1, "clip_high": 0.3, "dual_clip": None}
            )
        ).actor_rollout_ref.actor
    )
    ours, _ = weighted_policy_loss(old, lp, a, mask, "token-mean", plain, w)
    ref, _ = policy_loss(lp, old, a, w, clip_low=0.1, clip_high=0.3, dual_clip=None)
    assert float(ours) == pytest.approx(float(ref), rel=1e-6)
    dual, _ = policy_loss(lp, old, a, w, clip_low=0.1, clip_high=0.3, dual_clip=3.0)
    assert float(dual) != pytest.approx(float(ref), rel=1e-6)  # the setting matters here


def test_verl_computes_each_kl_estimator_by_the_name_it_is_given(model_dir, clean_registries):
    """One registry of KL estimators: each built-in one reaches verl's actor by its own name, and
    verl's kl_penalty of that name is our estimator (inside verl's clamps); a plugin's is refused
    under verl, naming the key."""
    from verl.trainer.ppo.core_algos import kl_penalty

    from tracetrain.registry import KL_ESTIMATORS

    g = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(4, 7, generator=g) * 3, -torch.rand(4, 7, generator=g) * 3
    for name in KL_ESTIMATORS.builtin():
        conf = build_verl_config(tracetrain_config(model_dir, loss={"kl_coef": 0.1, "kl_estimator": name}))
        given = omega_conf_to_dataclass(conf.actor_rollout_ref.actor).kl_loss_type
        torch.testing.assert_close(kl_penalty(lp, ref, given), KL_ESTIMATORS[name](lp, ref))
    KL_ESTIMATORS.register("k1-mine")(lambda lp, ref: lp - ref)
    with pytest.raises(ConfigError, match=r"'loss.kl_estimator': 'k1-mine' is a plugin's"):
        build_verl_config(tracetrain_config(model_dir, loss={"kl_estimator": "k1-mine"}))


def test_rollout_and_batch_sizes(model_dir):
    cfg = tracetrain_config(
        model_dir,
        rollout={"tasks_per_step": 12, "n_per_task": 4, "temperature": 0.7},
        aggregate={"max_prompt_length": 100, "max_response_length": 300},
        optim={"mini_batches": 3, "ppo_epochs": 2, "micro_batch_tokens": 50},
    )
    conf = build_verl_config(cfg, VerlConfig(nnodes=2, n_gpus_per_node=4, rollout_tp=2))
    rollout = omega_conf_to_dataclass(conf.actor_rollout_ref.rollout)
    assert (rollout.n, rollout.temperature, rollout.max_model_len) == (4, 0.7, 400)
    assert rollout.tensor_model_parallel_size == 2
    actor = conf.actor_rollout_ref.actor
    assert actor.ppo_epochs == 2 and actor.ppo_mini_batch_size == 4
    # A micro-batch must hold the longest row (prompt + response), whatever the budget says.
    assert actor.ppo_max_token_len_per_gpu == 400
    assert (conf.trainer.nnodes, conf.trainer.n_gpus_per_node) == (2, 4)
    roles, pools = verl_workers(conf)  # verl's validate_config passes
    assert pools.resource_pool_spec == {"global_pool": [4, 4]}
    assert Role.ActorRollout in roles and Role.ActorRolloutRef not in roles


def test_kl_needs_the_reference_worker(model_dir):
    roles, _ = verl_workers(build_verl_config(tracetrain_config(model_dir, loss={"kl_coef": 0.01})))
    assert Role.ActorRolloutRef in roles


def test_verls_trainer_is_built_for_our_steps(model_dir):
    cfg = tracetrain_config(model_dir, trainer={"steps": 7}, rollout={"tasks_per_step": 5})
    conf = build_verl_config(cfg)
    trainer = make_trainer(conf, cfg.rollout.tasks_per_step)
    assert trainer.total_training_steps == 7
    assert conf.actor_rollout_ref.actor.optim.total_training_steps == 7  # the lr schedule's length
    assert not trainer.use_critic and not trainer.use_reference_policy
    assert len(trainer.train_dataloader) == 1


def test_refused_settings_name_the_key(model_dir):
    with pytest.raises(ValueError, match="'model.kind'"):
        build_verl_config(build_config({}))
    with pytest.raises(ValueError, match="'optim.decay'"):
        build_verl_config(tracetrain_config(model_dir, optim={"decay": "linear"}))
    with pytest.raises(ValueError, match="'optim.mini_batches'"):
        build_verl_config(
            tracetrain_config(model_dir, rollout={"tasks_per_step": 5}, optim={"mini_batches": 2})
        )
    with pytest.raises(ValueError, match="'verl.rollout_tp'"):
        build_verl_config(tracetrain_config(model_dir), VerlConfig(n_gpus_per_node=6, rollout_tp=4))
    with pytest.raises(ValueError, match="no key 'actor_rollout_ref.actor.no_such_key'"):
        build_verl_config(
            tracetrain_config(model_dir),
            VerlConfig(overrides={"actor_rollout_ref.actor.no_such_key": 1}),
        )
    with pytest.raises(ValueError, match="verl refused"):
        build_verl_config(
            tracetrain_config(model_dir),
            VerlConfig(overrides={"actor_rollout_ref.actor.loss_agg_mode": "bogus"}),
        )
    with pytest.raises(ValueError, match="extra"):
        VerlConfig(gpus=8)
    conf = build_verl_config(
        tracetrain_config(model_dir),  # "+key" adds a key verl's yaml lacks
        VerlConfig(
            overrides={
                "+actor_rollout_ref.actor.fsdp_config.mixed_precision": {"param_dtype": "fp32"}
            }
        ),
    )
    assert conf.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    # ...in that config only: verl's composed defaults are cached, not changed
    plain = build_verl_config(tracetrain_config(model_dir))
    assert "mixed_precision" not in plain.actor_rollout_ref.actor.fsdp_config


def test_example_config_builds(model_dir):
    data = yaml.safe_load(EXAMPLE.read_text())
    section = data.pop("verl")
    data["model"]["path"] = model_dir
    if "verl" in TrainConfig.model_fields:  # once tracetrain.config has the `verl:` section
        data["verl"] = section
    cfg = build_config(data)
    conf = build_verl_config(cfg, VerlConfig(**section))
    assert conf.actor_rollout_ref.rollout.max_num_seqs == 512
    assert conf.trainer.n_gpus_per_node == 8
    verl_workers(conf)


def test_every_setting_is_a_key_of_verls_config(model_dir):
    """tracetrain sets only keys verl's own config has (a typo would be a silent no-op in verl)."""
    from tracetrain.integrations.verl.config import _has_key, verl_defaults, verl_settings

    defaults = verl_defaults()
    cfg = tracetrain_config(model_dir, loss={"kl_coef": 0.1, "entropy_coef": 0.01})
    assert [k for k in verl_settings(cfg) if not _has_key(defaults, k)] == []
    assert not _has_key(defaults, "actor_rollout_ref.actor.clip_ratio_typo")


def test_rollout_specs_keep_a_group_on_one_engine():
    specs = rollout_specs(["a", "b", "c"], 2, "s0", ["verl-0", "verl-1"])
    assert len({s["rollout_id"] for s in specs}) == 6
    by_group = {}
    for s in specs:
        by_group.setdefault(s["group_id"], set()).add(s["engine"])
    assert all(len(e) == 1 for e in by_group.values())
    assert [next(iter(by_group[f"s0-t{j}"])) for j in range(3)] == ["verl-0", "verl-1", "verl-0"]


def test_cli_backend_verl_names_what_it_needs(tmp_path, capsys):
    """`tracetrain train --backend verl` dispatches to the verl entry, which refuses what verl
    cannot load with one line naming the key (no traceback, status 2)."""
    from tracetrain.cli import main

    example = Path(__file__).resolve().parents[2] / "examples" / "guess"
    assert main(["train", "--backend", "verl", str(example / "config.yaml")]) == 2
    assert "config key 'trainer.precision'" in capsys.readouterr().err  # the demo's embedded-only keys
    assert main(["train", "--backend", "verl", str(example / "config.yaml"), "trainer.precision=fp32",
                 "trainer.collect=step"]) == 2
    assert "config key 'model.kind'" in capsys.readouterr().err
    missing = tmp_path / "no-model"
    assert main(["train", str(example / "verl.yaml"), f"model.path={missing}"]) == 2
    assert "config key 'model.path'" in capsys.readouterr().err


def test_the_example_says_how_to_make_its_model_and_the_command_works(tmp_path):
    """examples/guess/verl.yaml names models/tiny-guess: the command in its comment makes it, a
    model directory that loads offline and that the example's verl config accepts."""
    import shlex
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    text = EXAMPLE.read_text()
    (line,) = [x for x in text.splitlines() if x.lstrip("# ").startswith("python -c")]
    argv = shlex.split(line.lstrip("# "))
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(text)
    made = tmp_path / cfg["model"]["path"]
    model = AutoModelForCausalLM.from_pretrained(made, local_files_only=True)
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 4  # config.yaml's
    cfg["model"]["path"] = str(made)
    built = build_config(cfg)
    assert built.verl.n_gpus_per_node == 8
    build_verl_config(built, built.verl)  # verl's own checks of the example's settings


def test_a_hugging_face_id_reaches_verl_as_its_snapshot(tmp_path, monkeypatch):
    """model.path an id (offline, from the cache): verl's workers load its snapshot directory;
    an id not in the cache is refused naming the key and the cache."""
    from hub_cache import commit_of, offline, snapshot

    from tracetrain.integrations.verl.config import verl_settings
    from tracetrain.models.tiny import build_tokenizer

    folder = snapshot(tmp_path, "tiny-org/verl-tiny", commit_of("verl"))
    tiny_causal_lm(seed=0).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    offline(monkeypatch, tmp_path)
    settings = verl_settings(tracetrain_config("tiny-org/verl-tiny"))
    assert settings["actor_rollout_ref.model.path"] == str(folder.resolve())
    cache = re.escape(str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=r"'model\.path': 'tiny-org/elsewhere'.*" + cache):
        verl_settings(tracetrain_config("tiny-org/elsewhere"))
