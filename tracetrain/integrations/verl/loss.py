"""tracetrain's loss inside verl's actor update (checked against verl 0.9.1, FSDP/FSDP2 engine).

The idea: verl never chooses a divisor. tracetrain computes the token weights w[i,t] of every
mini-batch before verl splits anything (`weights.row_scales` over the whole mini-batch, see
minibatch.py), ships them in the DataProto, and the loss verl calls on each micro-batch is

    L_micro = dp_size * sum_{(i,t) in micro-batch} w[i,t] * l[i,t]

with l tracetrain's per-token loss (`loss.policy_loss`: the same PPO surrogate, dual clip, KL
estimators and entropy term, so the values equal tracetrain's own).

How verl 0.9.1 scales a loss, and what we do with each factor:

1. Micro-batches. `FSDPEngine.forward_backward_batch` calls `loss.backward()` on each micro-batch's
   loss as returned by the loss function, with no 1/num_micro_batches factor (the fp16 grad scaler
   aside, which unscales before the step): the gradients of the micro-batches add up. Our
   micro-batch losses are disjoint parts of one sum, so their sum is the mini-batch's L whatever
   the micro-batch size, fixed (`ppo_micro_batch_size_per_gpu`) or dynamic (`use_dynamic_bsz`).
2. Data parallelism. FSDP reduce-scatters gradients as an average over the dp ranks, so verl's
   own aggregations multiply by `dp_size` (`agg_loss`: "token-sum" is masked_sum * dp_size). We
   USE it the same way: the weights are multiplied by `global_batch_info["dp_size"]` (the registered
   policy loss) or `data["dp_size"]` (the loss function), and the average of the ranks' sums is the
   sum over all ranks: the single-process gradient.
3. `global_batch_info["batch_num_tokens"]` and `["global_batch_size"]` (verl's divisors for
   token-mean and the seq-mean modes) and `loss_scale_factor` (seq-mean-token-sum-norm) are
   NEUTRALISED: never read. The divisors live in w already, computed once per mini-batch, so
   `actor.loss_agg_mode` has no effect on our loss (verl still uses it for its entropy metric).
4. Mini-batches. verl cuts the rows it is given into mini-batches of `mini_batch_size` rows after
   chunking them over the dp ranks, and may shuffle them. `dataproto.to_dataproto` lays the rows
   out so that each verl mini-batch is exactly one tracetrain mini-batch (whole rollouts, the
   rows the weights were computed on), and `update_actor` turns shuffling off.

This scales like verl's own "token-sum" aggregation (a sum over the micro-batch times dp_size),
so the Megatron engine's extra factors (loss * num_micro_batch for its pipeline schedule) apply to
it as to "token-sum"; only the FSDP path is tested here (tests/integrations/test_verl_loss.py drives
verl's real TrainingWorker and FSDP2 engine on CPU).

Two entry points:

- `rollout-mean` (and one name per tracetrain mode, all the same function) registered with verl's
  `register_policy_loss`: selected by `actor.policy_loss.loss_mode` and called by verl's own
  `ppo_loss`. verl 0.9.1 hands a policy loss one per-token tensor besides the advantages,
  `rollout_is_weights`, which its own losses multiply into the per-token loss: the token weights
  travel in that key (TOKEN_WEIGHTS). verl's `ppo_loss` adds its KL and entropy terms aggregated by
  `loss_agg_mode`, not by w, which would break invariant 5; so this loss refuses to run with
  `use_kl_loss` or `entropy_coeff != 0`.
- `ppo_loss`, a verl loss function (the signature of `verl.workers.utils.losses.ppo_loss`), set on
  the actor with `actor_rollout_wg.set_loss_fn(partial(ppo_loss, config=actor_config))`: the
  surrogate, the KL to the reference (`ref_log_prob`) and the entropy, all with the same w.

The worker processes import this module through `actor_rollout_ref.model.external_lib` (see
trainer.py), which registers the losses there too.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_policy_loss
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.padding import no_padding_2_padding

from tracetrain.objective.loss import policy_loss
from tracetrain.objective.weights import MODES

TOKEN_WEIGHTS = "rollout_is_weights"  # the DataProto key of w [rows, S] (see the module docstring)
POLICY_LOSS_NAMES = tuple(MODES)  # "rollout-mean", "token-mean", ... (verl's policy-loss names)
KL_NAMES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
STRATEGIES = ("fsdp", "fsdp2")  # the engines whose scaling this module was checked against


def _clip_settings(config: Any) -> dict[str, Any]:
    """tracetrain's clip arguments from verl's actor config (clip_ratio_c = inf: no dual clip)."""
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    dual = float(config.get("clip_ratio_c", 3.0))
    return {
        "clip_low": float(low),
        "clip_high": float(high),
        "dual_clip": None if math.isinf(dual) else dual,
    }


def _check_strategy(config: Any) -> None:
    strategy = config.get("strategy", None)
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(
            f"actor.strategy {strategy!r}: tracetrain's verl loss is checked against {STRATEGIES} only"
        )


def _dp_weights(weights: torch.Tensor | None, mask: torch.Tensor, dp_size: Any) -> torch.Tensor:
    """dp_size * w * mask: FSDP averages the ranks' gradients, so each rank's sum is scaled by
    dp_size to make that average the sum over all ranks."""
    if weights is None:
        raise ValueError(
            f"tracetrain's verl loss needs the token weights in the batch key {TOKEN_WEIGHTS!r} "
            "(tracetrain.integrations.verl.dataproto.to_dataproto writes them)"
        )
    if weights.shape != mask.shape:
        raise ValueError(
            f"token weights have shape {tuple(weights.shape)}, the response mask {tuple(mask.shape)}"
        )
    dp = int(dp_size if dp_size is not None else 1)
    if dp < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size!r}")
    return weights.float() * mask.float() * dp


def weighted_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss: dp_size * sum_{i,t} w[i,t] * surrogate[i,t] over this micro-batch.

    w is `rollout_is_weights` (tracetrain's token weights, see the module docstring); the clip
    range and dual clip come from verl's actor config (clip_ratio_low / _high / _c). loss_agg_mode,
    batch_num_tokens, global_batch_size and loss_scale_factor are not used.
    """
    if config is None:
        raise ValueError("tracetrain's verl policy loss needs verl's actor config")
    _check_strategy(config)
    if config.get("use_kl_loss", False) or config.get("entropy_coeff", 0.0) != 0.0:
        raise ValueError(
            "verl's ppo_loss aggregates its KL and entropy terms by loss_agg_mode, not by "
            "tracetrain's token weights (docs/invariants.md invariant 5): with actor.use_kl_loss or "
            "actor.entropy_coeff != 0 set tracetrain.integrations.verl.loss.ppo_loss as the "
            "actor's loss function instead (actor_rollout_wg.set_loss_fn)"
        )
    dp_size = config.global_batch_info.get("dp_size", 1)
    weights = _dp_weights(rollout_is_weights, response_mask, dp_size)
    loss, m = policy_loss(log_prob, old_log_prob, advantages, weights, **_clip_settings(config))
    metrics = {
        "actor/pg_clipfrac": float(m["clip_frac"]),
        "actor/ppo_kl": float(m["approx_kl"]),
        "actor/pg_clipfrac_lower": float(m["dual_clip_frac"]),
    }
    return loss, metrics


for _name in POLICY_LOSS_NAMES:
    register_policy_loss(_name)(weighted_policy_loss)


def ppo_loss(config: Any, model_output: dict, data: Any, dp_group: Any = None):
    """verl loss function: L = dp_size * sum w * (surrogate + kl_coef * kl - entropy_coef * H).

    Drop-in for `verl.workers.utils.losses.ppo_loss` (same arguments; `data` is the micro-batch's
    TensorDict after verl's `left_right_2_no_padding`). KL: `actor.use_kl_loss`, `kl_loss_coef`,
    `kl_loss_type` in {kl|k1, mse|k2, low_var_kl|k3} against `ref_log_prob`; entropy:
    `actor.entropy_coeff` (the batch needs `calculate_entropy`).
    """
    _check_strategy(config)
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = model_output.get("entropy", None)
    use_kl = bool(config.use_kl_loss)
    entropy_coef = float(config.entropy_coeff)
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("actor.entropy_coeff != 0 needs the entropy: set calculate_entropy")
    if entropy is not None:
        entropy = no_padding_2_padding(entropy, data)
    kl_estimator = "k3"
    if use_kl:
        if config.kl_loss_type not in KL_NAMES:
            raise ValueError(
                f"actor.kl_loss_type {config.kl_loss_type!r} is not one of tracetrain's KL "
                f"estimators; use one of {sorted(KL_NAMES)}"
            )
        kl_estimator = KL_NAMES[config.kl_loss_type]
    fields = ["response_mask", "old_log_probs", "advantages", TOKEN_WEIGHTS]
    if use_kl:
        fields.append("ref_log_prob")
    missing = [k for k in fields if k not in data.keys()]
    if missing:
        raise ValueError(f"the actor's batch lacks {missing} (see dataproto.to_dataproto)")
    batch = data.select(*fields).to_padded_tensor()
    mask = batch["response_mask"].bool()
    dp_size = data["dp_size"]
    weights = _dp_weights(batch[TOKEN_WEIGHTS], mask, dp_size)
    loss, m = policy_loss(
        log_prob,
        batch["old_log_probs"],
        batch["advantages"],
        weights,
        **_clip_settings(config),
        ref_logprobs=batch["ref_log_prob"] if use_kl else None,
        kl_coef=float(config.kl_loss_coef) if use_kl else 0.0,
        kl_estimator=kl_estimator,
        entropy=entropy if entropy_coef != 0.0 else None,
        entropy_coef=entropy_coef,
    )
    # Each rank's values carry the factor dp_size; verl's Metric.aggregate_dp sums a SUM metric
    # over micro-batches and averages it over ranks: the mini-batch's total.
    total = {"actor/pg_loss": m["pg_loss"], "actor/weight_mass": m["weight_mass"]}
    if "kl_ref" in m:
        total["kl_loss"] = m["kl_ref"] * m["weight_mass"]
    if "entropy" in m:
        total["actor/entropy_loss"] = m["entropy"] * m["weight_mass"]
    metrics = {k: Metric(AggregationType.SUM, float(v)) for k, v in total.items()}
    for k, name in (
        ("clip_frac", "actor/pg_clipfrac"),
        ("approx_kl", "actor/ppo_kl"),
        ("dual_clip_frac", "actor/pg_clipfrac_lower"),
    ):
        metrics[name] = Metric(AggregationType.MEAN, float(m[k]))
    return loss, metrics
