"""The verl config of a tracetrain run: verl's own `ppo_trainer` config (Hydra), with the values
that follow from the tracetrain config set, and a `verl:` section for what only verl needs.

    VerlConfig             the `verl:` section (cluster shape, rollout engine, FSDP options),
                           defined in tracetrain.config with the other sections
    verl_settings(cfg, v)  {dotted verl key: value}: every value tracetrain decides
    build_verl_config      compose verl's ppo_trainer.yaml, apply those, then `v.overrides`;
                           the actor / rollout / model sections are validated by verl's dataclasses

No verl import at module level.
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path
from typing import Any

from tracetrain.config import ConfigError, VerlConfig
from tracetrain.models.hub import resolve_model_dir
from tracetrain.registry import KL_ESTIMATORS

LOSS_MODULE = (
    "tracetrain.integrations.verl.loss"  # imported by verl's workers: registers the losses
)
_MISSING = object()


def verl_settings(cfg: Any, v: VerlConfig | None = None) -> dict[str, Any]:
    """{dotted verl key: value} for tracetrain config `cfg` (a TrainConfig) and section `v`."""
    v = v or VerlConfig()
    m, rc, ac, lc, oc, tc = cfg.model, cfg.rollout, cfg.aggregate, cfg.loss, cfg.optim, cfg.trainer
    if m.kind != "pretrained" or not m.path:
        raise ConfigError(
            "config key 'model.kind': backend verl needs 'pretrained' with model.path, a Hugging "
            "Face model (a directory or an id) that verl's workers and rollout servers load "
            f"(got kind {m.kind!r}); tracetrain.models.tiny.save_tiny writes one for the tiny model"
        )
    model_dir = resolve_model_dir(m.path, m.revision, "model.path")  # an id: its snapshot
    if oc.decay not in ("constant", "cosine"):
        raise ConfigError(
            f"config key 'optim.decay': verl has no {oc.decay!r} schedule; use constant or cosine"
        )
    if rc.tasks_per_step % oc.mini_batches:
        raise ConfigError(
            f"config key 'optim.mini_batches': {oc.mini_batches} must divide "
            f"rollout.tasks_per_step ({rc.tasks_per_step}) for verl's batch-size checks"
        )
    gpus = v.nnodes * v.n_gpus_per_node
    if gpus % v.rollout_tp:
        raise ConfigError(
            f"config key 'verl.rollout_tp': {v.rollout_tp} must divide the {gpus} GPUs"
        )
    if lc.kl_estimator not in KL_ESTIMATORS.builtin():  # verl computes k1, k2, k3 by their names
        raise ConfigError(
            f"config key 'loss.kl_estimator': {lc.kl_estimator!r} is a plugin's; backend verl "
            f"computes the KL in its own workers, by name: {', '.join(KL_ESTIMATORS.builtin())}"
        )
    max_len = ac.max_prompt_length + ac.max_response_length
    actor, rollout, ref = (
        "actor_rollout_ref.actor",
        "actor_rollout_ref.rollout",
        "actor_rollout_ref.ref",
    )
    use_kl = lc.kl_coef > 0
    return {
        "trainer.use_v1": False,  # RayPPOTrainer's workers; tracetrain drives the loop
        "trainer.nnodes": v.nnodes,
        "trainer.n_gpus_per_node": v.n_gpus_per_node,
        "trainer.total_epochs": 1,
        "trainer.total_training_steps": tc.steps,
        "trainer.project_name": "tracetrain",
        "trainer.experiment_name": Path(tc.run_dir).name,
        "trainer.default_local_dir": str(Path(tc.run_dir) / "verl"),
        "trainer.logger": ["console"],
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.save_freq": tc.checkpoint_every or -1,
        "trainer.balance_batch": False,  # tracetrain lays the rows out (dataproto.py)
        "data.train_batch_size": rc.tasks_per_step,
        "data.dataloader_num_workers": 0,  # verl's dataloader is not iterated
        "data.max_prompt_length": ac.max_prompt_length,
        "data.max_response_length": ac.max_response_length,
        "algorithm.adv_estimator": "grpo",  # not used (tracetrain's advantages); means no critic
        "algorithm.use_kl_in_reward": False,
        "algorithm.rollout_correction.bypass_mode": False,  # rollout_is_weights carry token weights
        "algorithm.rollout_correction.rollout_is": None,
        "actor_rollout_ref.model.path": str(
            Path(model_dir).expanduser().resolve()
        ),  # Ray workers' cwd
        "actor_rollout_ref.model.external_lib": LOSS_MODULE,
        "actor_rollout_ref.model.enable_gradient_checkpointing": v.gradient_checkpointing,
        "actor_rollout_ref.model.use_remove_padding": v.use_remove_padding,
        f"{actor}.strategy": v.strategy,
        f"{actor}.policy_loss.loss_mode": lc.mode,
        f"{actor}.clip_ratio": lc.clip_low,
        f"{actor}.clip_ratio_low": lc.clip_low,
        f"{actor}.clip_ratio_high": lc.clip_high,
        f"{actor}.clip_ratio_c": lc.dual_clip if lc.dual_clip is not None else math.inf,
        f"{actor}.entropy_coeff": lc.entropy_coef,
        f"{actor}.calculate_entropy": lc.entropy_coef > 0,
        f"{actor}.use_kl_loss": use_kl,
        f"{actor}.kl_loss_coef": lc.kl_coef if use_kl else 0.001,
        f"{actor}.kl_loss_type": lc.kl_estimator,
        f"{actor}.ppo_epochs": oc.ppo_epochs,
        f"{actor}.shuffle": False,
        f"{actor}.ppo_mini_batch_size": rc.tasks_per_step // oc.mini_batches,
        f"{actor}.use_dynamic_bsz": True,
        f"{actor}.ppo_max_token_len_per_gpu": max(oc.micro_batch_tokens, max_len),
        f"{actor}.grad_clip": oc.grad_clip,
        f"{actor}.optim.clip_grad": oc.grad_clip,
        f"{actor}.optim.lr": oc.lr,
        f"{actor}.optim.weight_decay": oc.weight_decay,
        f"{actor}.optim.lr_warmup_steps": oc.warmup_steps,
        f"{actor}.optim.lr_scheduler_type": oc.decay,
        f"{actor}.fsdp_config.param_offload": v.param_offload,
        f"{actor}.fsdp_config.optimizer_offload": v.optimizer_offload,
        f"{rollout}.name": v.rollout,
        f"{rollout}.n": rc.n_per_task,
        f"{rollout}.temperature": rc.temperature,
        f"{rollout}.top_p": rc.top_p,
        f"{rollout}.tensor_model_parallel_size": v.rollout_tp,
        f"{rollout}.gpu_memory_utilization": v.gpu_memory_utilization,
        f"{rollout}.prompt_length": ac.max_prompt_length,
        f"{rollout}.response_length": ac.max_response_length,
        f"{rollout}.max_model_len": max_len,
        f"{rollout}.logprobs_mode": "processed_logprobs",  # temperature-scaled, as the trainer's
        f"{rollout}.skip_tokenizer_init": False,
        f"{rollout}.log_prob_use_dynamic_bsz": True,
        f"{rollout}.log_prob_max_token_len_per_gpu": max(oc.micro_batch_tokens, max_len),
        f"{ref}.log_prob_use_dynamic_bsz": True,
        f"{ref}.log_prob_max_token_len_per_gpu": max(oc.micro_batch_tokens, max_len),
    }


def _has_key(conf, key: str) -> bool:
    """Whether verl's config has `key` (a required value, `???`, counts)."""
    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(conf, parent, default=_MISSING) if parent else conf
    return node is not _MISSING and hasattr(node, "keys") and leaf in node.keys()


@functools.cache
def _composed_defaults():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from verl.trainer import main_ppo

    config_dir = str(Path(main_ppo.__file__).parent / "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer")


def verl_defaults():
    """A fresh copy of verl's own `ppo_trainer` config, composed by Hydra from the installed verl
    (composed once per process)."""
    return copy.deepcopy(_composed_defaults())


def build_verl_config(cfg: Any, v: VerlConfig | None = None):
    """verl's composed `ppo_trainer` config (an OmegaConf DictConfig) for this tracetrain run.

    Raises ConfigError naming the key when a value is refused (by tracetrain's checks above, by
    OmegaConf for an unknown key in `verl.overrides`, or by verl's config dataclasses).
    """
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException
    from verl.utils.config import omega_conf_to_dataclass

    v = v or VerlConfig()
    conf = verl_defaults()
    settings = verl_settings(cfg, v)
    added = set()
    for key in v.overrides:  # "+key" adds a key verl's yaml lacks (Hydra's convention)
        if key.startswith("+"):
            added.add(key[1:])
        elif not _has_key(conf, key):
            raise ConfigError(
                f"config key 'verl.overrides': verl's config has no key {key!r} "
                "(write '+key' to add one)"
            )
        settings[key.removeprefix("+")] = v.overrides[key]
    for key, value in settings.items():
        try:
            if key in added:
                with open_dict(conf):
                    OmegaConf.update(conf, key, value, merge=True, force_add=True)
            else:  # struct mode: a key verl's config lacks is an error
                OmegaConf.update(conf, key, value, merge=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"verl config key {key!r} = {value!r}: {e}") from None
    try:
        OmegaConf.resolve(conf)
        # (the model section is checked by verl's workers: HFModelConfig loads the model's files)
        for section in ("actor_rollout_ref.actor", "actor_rollout_ref.rollout"):
            omega_conf_to_dataclass(OmegaConf.select(conf, section))
    except (HydraException, OmegaConfBaseException, ValueError, TypeError, AssertionError) as e:
        raise ConfigError(f"verl refused the config: {type(e).__name__}: {e}") from None
    return conf
