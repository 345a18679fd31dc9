"""The learn stage: PPO epochs over mini-batches of whole rollouts, one optimizer update each.

    for epoch: plan the mini-batches (minibatch.plan_step: whole rollouts; token weights fixed
               before micro-batches and ranks)
        for mini-batch: sum over micro-batches of policy_loss -> backward (DDP: all-reduce once,
                        on the last micro-batch) -> clip grad norm -> AdamW step -> lr schedule

`ppo_update` is what the embedded trainer runs on its update thread; the verl backend hands the
same rows and weights to verl's actor instead (integrations/verl).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from tracetrain.config import TrainConfig
from tracetrain.learn.distributed import DataParallel, sum_over_ranks
from tracetrain.learn.packing import default_pack_tokens, row_costs, row_logprobs
from tracetrain.objective.correction import correct
from tracetrain.objective.loss import policy_loss
from tracetrain.objective.minibatch import plan_step
from tracetrain.objective.weights import RowWeights, rollout_mass


def lr_factor(step: int, *, warmup: int, total: int, decay: str) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based): linear warm-up, then decay."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * frac)) if decay == "cosine" else 1.0 - frac


ADDITIVE_METRICS = ("pg_loss", "weight_mass")  # policy_loss sums; its other metrics are weighted means
TOKEN_METRICS = ("tokens_computed", "tokens_padded")  # per micro-batch, summed over ranks


@dataclass
class UpdateResult:
    loss: float
    grad_norm: float
    metrics: dict[str, float]
    # |logprob the engine recorded - the trainer's| over the first mini-batch's trained tokens,
    # before the first optimizer step ({"mean", "max"}); None unless measure_gap
    logprob_gap: dict[str, float] | None = None
    # correction.correct's metrics (the step's, on the first update's result); None when off
    correction: dict[str, float] | None = None


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch,
    advantages: torch.Tensor,
    cfg: TrainConfig,
    *,
    ref_model: torch.nn.Module | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    dp: DataParallel = DataParallel(),
    measure_gap: bool = False,
) -> list[UpdateResult]:
    """PPO epochs over mini-batches of whole rollouts; the loss of a mini-batch is the plain sum
    of its micro-batch losses (weights computed once per mini-batch, see minibatch.py).

    Data parallel (`dp` enabled, `model` wrapped in DDP): every rank gets the same batch and plan;
    this rank trains its shard's micro-batches; DDP all-reduces once per mini-batch (on the last
    micro-batch), so the update equals the one-process update. Metrics are summed over ranks.

    measure_gap (the rollouts came from these very weights): the first update's result carries
    mean and max |engine logprob - trainer logprob| over its trained tokens (this rank's).

    cfg.correction.old "trainer": the ratio is taken against the policy's own logprobs before the
    first update (one no-grad pass over the rows), and correction.correct's v and kept mask (from
    those and the engine's) are fixed for the step before any plan, micro-batch or rank."""
    lc, oc = cfg.loss, cfg.optim
    need_entropy = lc.entropy_coef > 0
    precision, temperature = cfg.trainer.precision, cfg.rollout.temperature
    dev = next(model.parameters()).device  # the step's tensors go there (planning stays on the CPU)
    ids_all, att_all, pos_all, mask_all = (t.to(dev) for t in (
        batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask))
    # [rows] one per row from one per rollout, or [rows, R] per token (turn-level credit)
    adv_rows = (advantages if advantages.dim() == 2 else advantages[batch.rollout_index]).to(dev)
    R = batch.response_length
    cc = cfg.correction
    behaviour = batch.rollout_logprobs  # the engine's, each token's own turn version
    train_mask = batch.response_mask  # with rejected rollouts cleared (correction.reject)
    pack, share = oc.pack_rows, oc.pack_rows and oc.share_prefixes
    budget = oc.micro_batch_tokens
    if pack:  # a micro-batch is one pack: budget in computed tokens, capped (dense mask, N^2)
        budget = min(budget, oc.pack_tokens or default_pack_tokens(model))

    def pack_costs(rows: torch.Tensor) -> torch.Tensor:  # a micro-batch's rows, in order
        return row_costs(batch.input_ids[rows], batch.attention_mask[rows], share=share)

    def plan(world_size: int = dp.world_size, rank: int = dp.rank):
        return plan_step(train_mask, batch.rollout_index,
                         n_mini_batches=min(oc.mini_batches, batch.n_rollouts),
                         micro_batch_tokens=budget, mode=lc.mode, norm_length=lc.norm_length,
                         row_tokens=batch.attention_mask.sum(1),
                         micro_costs=pack_costs if pack else None, world_size=world_size, rank=rank)

    def forward(m, rows: torch.Tensor, *, entropy: bool = False, packed=None):
        """(logprobs, entropy, pack, tokens computed, tokens a padded batch computes) of `rows`."""
        # The first column that is not left padding in every row of this micro-batch: the
        # padded forward starts there (and computes rows x the columns from there on).
        real = batch.attention_mask[rows]
        first = int((real.sum(0) > 0).int().argmax())
        start = 0 if pack else first
        rd = rows.to(dev)
        lp, ent, pk = row_logprobs(
            m, ids_all[rd, start:], att_all[rd, start:], pos_all[rd, start:], R, mask_all[rd],
            pack=pack, share=share, chunk=oc.logprob_chunk, temperature=temperature,
            with_entropy=entropy, precision=precision, packed=packed)
        padded = rows.numel() * (real.shape[1] - first)
        return lp, ent, pk, (pk.n_tokens if pk is not None else padded), padded

    old_all, is_all, corrected = behaviour, None, None
    # the engine gave no logprobs, or the ratio is against the proximal policy: the policy before
    # this step's first update, over every row
    if old_all is None or cc.old == "trainer":
        old_all = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=dev)
        with torch.no_grad():
            for mb in plan(1, 0):
                for micro in mb.micro_batches:
                    old_all[micro.rows.to(dev)] = forward(model, micro.rows)[0]
        if cc.old == "trainer" and behaviour is not None:
            corrected = correct(old_all.cpu(), behaviour, batch.response_mask, batch.rollout_index,
                                weight=cc.weight, cap=cc.cap, mask_mode=cc.mask,
                                band=tuple(cc.band), reject=tuple(cc.reject) if cc.reject else None)
            train_mask, is_all = corrected.mask, corrected.is_weights
            if corrected.metrics["correction/rejected_rollouts"]:  # their rows leave the step
                keep = (train_mask.any(1) | ~batch.response_mask.any(1)).nonzero().squeeze(1)
                if not keep.numel():  # every rollout rejected: no update
                    return [UpdateResult(0.0, 0.0, {}, None, corrected.metrics)]
                batch, train_mask, old_all = batch.select_rows(keep), train_mask[keep], old_all[keep.to(dev)]
                adv_rows, behaviour = adv_rows[keep.to(dev)], behaviour[keep]
                is_all = None if is_all is None else is_all[keep]
                ids_all, att_all, pos_all = (t.to(dev) for t in (
                    batch.input_ids, batch.attention_mask, batch.position_ids))
            mask_all = train_mask.to(dev)
            is_all = None if is_all is None else is_all.to(dev)
    old_all = old_all.to(dev)
    behaviour = None if behaviour is None else behaviour.to(dev)
    results = []
    gap_sum, gap_max, gap_n = 0.0, 0.0, 0
    model.train()
    mini_batches = plan()  # the same for every epoch: a function of the rows alone
    for _epoch in range(oc.ppo_epochs):
        for mb in mini_batches:
            optimizer.zero_grad(set_to_none=True)
            total, sums = 0.0, {}
            for j, micro in enumerate(mb.micro_batches):
                last = j == len(mb.micro_batches) - 1
                sync = model.no_sync() if dp.enabled and not last else contextlib.nullcontext()
                with sync:  # the forward too: DDP arms its all-reduce in the forward pass
                    rows_dev = micro.rows.to(dev)
                    lp, ent, pk, computed, padded = forward(model, micro.rows, entropy=need_entropy)
                    # no optimizer step yet: the weights the engine sampled with
                    if measure_gap and behaviour is not None and not results:
                        d = (lp.detach() - behaviour[rows_dev]).abs()[mask_all[rows_dev].bool()]
                        if d.numel():
                            gap_sum, gap_n = gap_sum + float(d.sum()), gap_n + d.numel()
                            gap_max = max(gap_max, float(d.max()))
                    ref = None
                    if ref_model is not None:
                        with torch.no_grad():
                            ref = forward(ref_model, micro.rows, packed=pk)[0]
                    loss, m = policy_loss(
                        lp, old_all[rows_dev], adv_rows[rows_dev],
                        RowWeights(mask_all[rows_dev], micro.row_scales.to(dev)),
                        clip_low=lc.clip_low, clip_high=lc.clip_high, dual_clip=lc.dual_clip,
                        is_weights=None if is_all is None else is_all[rows_dev],
                        ref_logprobs=ref, kl_coef=lc.kl_coef, kl_estimator=lc.kl_estimator,
                        entropy=ent, entropy_coef=lc.entropy_coef,
                    )
                    loss.backward()
                total += float(loss.detach())
                m = {**m, "tokens_computed": computed, "tokens_padded": padded}
                # pg_loss, weight_mass and token counts add up over micro-batches; the rest are
                # weighted means within the micro-batch, so they add up weighted by its mass.
                mass = float(m["weight_mass"])
                for k, v in m.items():
                    plain = k in ADDITIVE_METRICS or k in TOKEN_METRICS
                    sums[k] = sums.get(k, 0.0) + (float(v) if plain else float(v) * mass)
            if dp.enabled:  # each rank's losses carry a factor W (minibatch.py): sum, then / W
                keys = sorted(sums)
                summed = sum_over_ranks([total, *(sums[k] for k in keys)], dp)
                total, sums = summed[0] / dp.world_size, dict(zip(keys, summed[1:], strict=True))
            mass, W = sums.get("weight_mass", 0.0), dp.world_size
            means = {k: (v if k in TOKEN_METRICS else v / W if k in ADDITIVE_METRICS
                         else v / mass if mass else 0.0) for k, v in sums.items()}
            # Each rollout's share of this update (1/R each in rollout-mean, however many rows).
            per_rollout = rollout_mass(train_mask[mb.rows], batch.rollout_index[mb.rows],
                                       mb.row_scales)
            lo, hi = (float(per_rollout.min()), float(per_rollout.max())) if per_rollout.numel() else (0.0, 0.0)
            means["rollout_mass_min"], means["rollout_mass_max"] = lo, hi
            means["n_rollouts"] = float(per_rollout.numel())
            # x R within this update (a mean of products over updates, not of the two factors)
            means["rollout_mass_x_R_min"] = lo * per_rollout.numel()
            means["rollout_mass_x_R_max"] = hi * per_rollout.numel()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip))
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            gap = {"mean": gap_sum / gap_n, "max": gap_max} if measure_gap and gap_n and not results else None
            results.append(UpdateResult(total, grad_norm, means, gap,
                                        None if results or corrected is None else corrected.metrics))
    model.eval()
    return results
