"""Several policies in one run (config `policies`): each a LoRA adapter on the run's base model,
named by the policy, or a whole model of its own (`lora: null`: a copy of the run's model as RL
starts, or `model`: one loaded), that makes its roles' calls and learns from their trained
tokens only.

    serve     the gateway names each call's adapter by its role (role_adapters; a role of no
              policy: the base model alone); the local engine decodes a batch of several adapters;
              a whole-model policy's roles go to a local engine of its own (role_engines), on
              its model in place
    rows_p    the step's rollouts aggregated with roles.train = p's roles: rows of p's turns only
              (each role's turns chain apart, rows/roles.py), and their advantages
    R_p       the rollouts holding a trained token of p; each weighs 1/R_p in p's loss
    update_p  adapter p active (its parameters alone require a gradient), or p's own model; p's
              AdamW and schedule, optimizer settings and KL coefficient (TrainConfig.for_policy),
              its KL reference (the base; a whole model: a frozen copy of its own as RL starts)

Each policy's update is the single-policy update on its own rows, so isolation (q's calls change
none of p's rows, weights or gradients) and the reduction (one policy holding every trained role
is the run without `policies`, with that adapter as model.lora) hold by construction
(docs/policies.md, docs/invariants.md 11-12). The policies share one model version: every step
bumps it once, whichever policies had rows.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from tracetrain.config import ConfigError, TrainConfig
from tracetrain.learn.distributed import DataParallel
from tracetrain.learn.optim import optimizer_and_schedule
from tracetrain.learn.update import UpdateResult, ppo_update
from tracetrain.models import lora
from tracetrain.run.step import Rows, build_rows, update_metrics


class ByPolicy(dict):
    """{policy: optimizer} or {policy: scheduler}: saved and restored as one (state_dict)."""

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state) != sorted(self):
            raise ValueError(f"a checkpoint of policies {sorted(state)}; this run's are {sorted(self)}")
        for name, part in self.items():
            part.load_state_dict(state[name])

    def get_last_lr(self) -> list[float]:
        """The first policy's (a scheduler's `lr` metric); each policy's is policy/<p>/lr."""
        return next(iter(self.values())).get_last_lr()


def whole_models(cfg: TrainConfig, model: torch.nn.Module, tokenizer) -> dict[str, torch.nn.Module]:
    """{policy: its model} of the whole-model policies: `policies.<p>.model` loaded (its
    tokenizer must be the run's: a call's token ids are the run's tokenizer's), or a copy of
    `model` (the run's, before any adapter; copy_base refreshes it after the warm start)."""
    from tracetrain.models.load import load_policy

    out = {}
    for name in cfg.whole_policies:
        mc = cfg.policies[name].model
        if mc is None:
            out[name] = copy.deepcopy(model).eval()
            continue
        own, own_tokenizer = load_policy(mc, seed=cfg.trainer.seed, key=f"policies.{name}.model")
        if own_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"config key 'policies.{name}.model': its tokenizer is not the run's "
                              "model's (every call is tokenized by the run's tokenizer)")
        out[name] = own.eval()
    return out


def engine_name(policy: str) -> str:
    """The gateway's name of a whole-model policy's engine."""
    return f"policy-{policy}"


def serve(gateway, cfg: TrainConfig, whole: Mapping[str, Any]) -> None:
    """Each call by its role's policy (training and eval alike): an adapter policy's roles by its
    adapter on the default engine (a role of no policy: the base), a whole-model policy's roles
    by its own engine (engine_name; the caller registered it)."""
    if cfg.adapter_policies:
        gateway.serve_policies({r: p for r, p in cfg.role_policies.items() if p in cfg.adapter_policies})
    for name in whole:
        gateway.role_engines.update(dict.fromkeys(cfg.policies[name].roles, engine_name(name)))


def copy_base(cfg: TrainConfig, model: torch.nn.Module, whole: dict[str, torch.nn.Module]) -> None:
    """The whole-model policies without a model of their own take `model`'s base weights (after
    the warm start: the backbone every policy starts from), in place."""
    copies = [name for name in whole if cfg.policies[name].model is None]
    if copies:
        state = lora.base(model).state_dict()
        for name in copies:
            whole[name].load_state_dict(state)


def optimizers(cfg: TrainConfig, model: torch.nn.Module,
               whole: Mapping[str, torch.nn.Module] = {}) -> tuple[ByPolicy, ByPolicy]:  # noqa: B006 (read only)
    """Each policy's AdamW over its adapter's parameters (a whole model: all of its own), and
    its schedule."""
    made = {name: optimizer_and_schedule(
                list(whole[name].parameters()) if name in whole else lora.policy_parameters(model, name),
                cfg.for_policy(name).optim, cfg.trainer.steps)
            for name in cfg.policies}
    return ByPolicy({n: o for n, (o, _) in made.items()}), ByPolicy({n: s for n, (_, s) in made.items()})


def needs_reference(cfg: TrainConfig, name: str | None = None) -> bool:
    """Whether a KL reference is needed: loss.kl_coef > 0; with several policies, policy `name`'s
    kl_coef (None: any adapter policy's, whose reference is the base)."""
    if cfg.policies is None:
        return cfg.loss.kl_coef > 0
    names = [name] if name is not None else list(cfg.adapter_policies)
    return any(cfg.for_policy(n).loss.kl_coef > 0 for n in names)


def references(cfg: TrainConfig, whole: Mapping[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """{whole-model policy: a frozen copy of its model} for those with a KL coefficient."""
    from tracetrain.run.checkpoint import frozen_copy

    return {name: frozen_copy(m) for name, m in whole.items() if needs_reference(cfg, name)}


def build_policy_rows(store, results, cfg: TrainConfig, tokenizer, version: int) -> dict[str, Rows]:
    """{policy: its rows, advantages and row metrics} (run/step.build_rows under TrainConfig.for_policy)."""
    return {name: build_rows(store, results, cfg.for_policy(name), tokenizer, version)
            for name in cfg.policies}


def row_metrics(parts: dict[str, Rows]) -> dict[str, Any]:
    """policy/<p>/aggregate/*, policy/<p>/advantage/*, policy/<p>/distill/* (its teacher's) and
    policy/<p>/entropy/sampled of each policy's rows."""
    return {f"policy/{name}/{k}": v for name, rows in parts.items() for k, v in rows.metrics.items()
            if k.startswith(("aggregate/", "advantage/", "distill/", "entropy/"))}


def update(models: dict[str, torch.nn.Module], parts: dict[str, Rows], optimizers: ByPolicy,
           schedulers: ByPolicy, cfg: TrainConfig, *, refs: Mapping[str, torch.nn.Module | None] = {},  # noqa: B006
           measure_gap: bool = True, stop=None,
           dp: DataParallel = DataParallel()) -> dict[str, list[UpdateResult]]:
    """Each policy with rows: its update (learn/update.ppo_update) with its adapter active (a
    whole-model policy: its own model), its optimizer, schedule, config and KL reference
    (`refs`); {policy: its updates' results}. `models`: what each policy's forward runs
    (distributed.wrap_policies: the model, or under torchrun p's DDP wrapper); every rank runs
    the same policies in the same order. A stop request is honoured before the first
    policy's first optimizer step only: after it, every policy's update runs (a step whose update
    is half done is no step's state)."""
    out, first = {}, True
    for name, rows in parts.items():
        if not rows.batch.n_rows:
            continue
        if name in cfg.adapter_policies:  # p's parameters alone require a gradient
            getattr(models[name], "module", models[name]).set_adapter(name)
        try:
            out[name] = ppo_update(models[name], optimizers[name], rows.batch, rows.advantages,
                                   cfg.for_policy(name), ref_model=refs.get(name),
                                   scheduler=schedulers[name], measure_gap=measure_gap,
                                   stop=stop if first else None, dp=dp)
        finally:
            optimizers[name].zero_grad(set_to_none=True)  # the next policy's clip sees no stale grad
        first = False
    return out


def policy_update_metrics(updates: dict[str, list[UpdateResult]], schedulers: ByPolicy) -> dict[str, float]:
    """policy/<p>/{loss, grad_norm, loss/*, engine/*, lr} and time/policy/<p>/update/* of each
    policy that updated, and the step's over them: a *_min key their min, a *_max key their max,
    a time/* key their sum (the policies update one after the other), any other their mean (with
    one policy: its own, as a run without `policies` logs them)."""
    per = {name: update_metrics(results) for name, results in updates.items()}
    out: dict[str, float] = {}
    for name, m in per.items():
        out.update({f"time/policy/{name}/{k[5:]}" if k.startswith("time/") else f"policy/{name}/{k}": v
                    for k, v in m.items()})
        out[f"policy/{name}/lr"] = schedulers[name].get_last_lr()[0]
    for key in {k for m in per.values() for k in m}:
        values = [m[key] for m in per.values() if key in m]
        out[key] = (min(values) if key.endswith("_min") else max(values) if key.endswith("_max")
                    else sum(values) if key.startswith("time/") else sum(values) / len(values))
    return out
