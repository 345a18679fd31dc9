"""The learn stage: PPO epochs over mini-batches of whole rollouts, one optimizer update each.

    for epoch: plan the mini-batches (minibatch.plan_step: whole rollouts; token weights fixed
               before micro-batches and ranks)
        for mini-batch: sum over micro-batches of policy_loss -> backward (DDP: all-reduce once,
                        on the last micro-batch) -> clip grad norm -> AdamW step -> lr schedule

`ppo_update` is what the embedded trainer runs on its update thread; the verl backend hands the
same rows and weights to verl's actor instead (integrations/verl). `stop` (run/stop.py) is asked
before each micro-batch until the first optimizer step: when it says yes the update raises
UpdateStopped with the weights and the optimizer as they were (the gradients dropped).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tracetrain.config import TrainConfig
from tracetrain.learn.distributed import DataParallel, sum_over_ranks
from tracetrain.learn.optim import clip_grad_norm
from tracetrain.learn.packing import default_pack_tokens, pack_rows, packable, row_costs, row_logprobs
from tracetrain.learn.phases import Phases
from tracetrain.objective.correction import correct
from tracetrain.objective.loss import policy_loss
from tracetrain.objective.minibatch import plan_step
from tracetrain.objective.weights import RowWeights, rollout_mass

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
    # the whole step's seconds per phase (phases.Phases.metrics), on the first update's result
    times: dict[str, float] | None = None


@dataclass
class StepRows:
    """The step's rows as the update reads them: the batch (on the CPU, where planning runs) and
    its tensors on the model's device (rows/batch.py's letters: P prompt, S response positions).

    ids, att, pos: [rows, P+S] on the device; adv: [rows] (the rollout's) or [rows, S] (each
    token's credit); mask: [rows, S], the trained response tokens (the response mask less what
    correction rejected or masked; `train_mask` is the same on the CPU); old: [rows, S] the
    logprobs the PPO ratio is taken against; behaviour: [rows, S] the engine's, or None;
    is_weights: [rows, S] the importance weights of correction.weight, or None."""

    batch: object  # rows.batch.TrainingBatch
    ids: torch.Tensor
    att: torch.Tensor
    pos: torch.Tensor
    adv: torch.Tensor
    train_mask: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor | None
    behaviour: torch.Tensor | None
    is_weights: torch.Tensor | None = None

    @classmethod
    def of(cls, batch, advantages: torch.Tensor, dev: torch.device) -> StepRows:
        ids, att, pos, mask = (t.to(dev) for t in (
            batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask))
        adv = advantages if advantages.dim() == 2 else advantages[batch.rollout_index]
        behaviour = batch.rollout_logprobs  # each token's own turn version
        return cls(batch, ids, att, pos, adv.to(dev), batch.response_mask, mask, None,
                   None if behaviour is None else behaviour.to(dev))

    def keep(self, rows: torch.Tensor) -> StepRows:
        """Only rows `rows` (the rows of the rollouts correction did not reject)."""
        d = self.ids.device
        batch = self.batch.select_rows(rows)
        ids, att, pos = (t.to(d) for t in (batch.input_ids, batch.attention_mask, batch.position_ids))
        pick = lambda t: None if t is None else t[rows.to(t.device)]  # noqa: E731
        return StepRows(batch, ids, att, pos, pick(self.adv), pick(self.train_mask),
                        pick(self.mask), pick(self.old), pick(self.behaviour), pick(self.is_weights))


class Forward:
    """Logprobs (and entropy) of a micro-batch's rows under a model: packed into one sequence per
    micro-batch (optim.pack_rows, for a model whose layers are all full attention: packing.packable;
    shared prompts computed once with optim.share_prefixes), or padded from the first column that
    is not left padding in every row. Its seconds go to `phases`: packing to `pack`, the pass to
    the phase the caller names (forward, old, reference)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, phases: Phases | None = None):
        self.phases = phases or Phases()
        oc = cfg.optim
        self.pack = oc.pack_rows and packable(model)  # (sliding windows, conv layers: padded)
        self.share = self.pack and oc.share_prefixes
        self.chunk, self.temperature = oc.logprob_chunk, cfg.rollout.temperature
        self.precision = cfg.trainer.precision
        # a micro-batch is one pack: its budget in computed tokens, capped (dense mask, N^2)
        self.budget = (min(oc.micro_batch_tokens, oc.pack_tokens or default_pack_tokens(model))
                       if self.pack else oc.micro_batch_tokens)

    def costs(self, s: StepRows):
        """rows -> each row's computed tokens in a pack (for the planner), or None when padded."""
        if not self.pack:
            return None
        return lambda rows: row_costs(s.batch.input_ids[rows], s.batch.attention_mask[rows],
                                      share=self.share)

    def __call__(self, m: torch.nn.Module, s: StepRows, rows: torch.Tensor, *,
                 entropy: bool = False, packed=None, phase: str = "forward"):
        """(logprobs [n, S], entropy [n, S] | None, pack, tokens computed, tokens a padded batch
        computes) of `rows` (n of them)."""
        real = s.batch.attention_mask[rows]
        first = int((real.sum(0) > 0).int().argmax())
        start = 0 if self.pack else first
        rd = rows.to(s.ids.device)
        if self.pack and packed is None:  # the pack of the rows whole (start 0), as row_logprobs'
            with self.phases.phase("pack"):
                packed = pack_rows(s.batch.input_ids[rows], real, share=self.share)
        with self.phases.phase(phase):
            lp, ent, pk = row_logprobs(
                m, s.ids[rd, start:], s.att[rd, start:], s.pos[rd, start:], s.batch.response_length,
                s.mask[rd], pack=self.pack, share=self.share, chunk=self.chunk,
                temperature=self.temperature, with_entropy=entropy, precision=self.precision,
                packed=packed)
        padded = rows.numel() * (real.shape[1] - first)
        return lp, ent, pk, (pk.n_tokens if pk is not None else padded), padded


class UpdateStopped(Exception):
    """A stop was asked before the update's first optimizer step: nothing of it was applied."""


def _check(stop: Callable[[], bool] | None, optimizer: torch.optim.Optimizer | None = None) -> None:
    if stop is not None and stop():
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        raise UpdateStopped


def plan(s: StepRows, fwd: Forward, cfg: TrainConfig, world_size: int, rank: int):
    """The step's mini-batches of whole rollouts and this rank's micro-batches (minibatch.py)."""
    return plan_step(s.train_mask, s.batch.rollout_index,
                     n_mini_batches=min(cfg.optim.mini_batches, s.batch.n_rollouts),
                     micro_batch_tokens=fwd.budget, mode=cfg.loss.mode,
                     norm_length=cfg.loss.norm_length, row_tokens=s.batch.attention_mask.sum(1),
                     micro_costs=fwd.costs(s), world_size=world_size, rank=rank)


def proximal_logprobs(model: torch.nn.Module, s: StepRows, fwd: Forward, cfg: TrainConfig,
                      stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """[rows, S]: the policy's logprobs before this step's first update, over every row (no grad)."""
    old = torch.zeros(s.train_mask.shape, dtype=torch.float32, device=s.ids.device)
    with torch.no_grad():
        for mb in plan(s, fwd, cfg, 1, 0):
            for micro in mb.micro_batches:
                _check(stop)
                old[micro.rows.to(old.device)] = fwd(model, s, micro.rows, phase="old")[0]
    return old


def apply_correction(s: StepRows, cfg: TrainConfig):
    """(rows, correction.correct's result) with the correction's mask and weights fixed for the
    step; the rows of rejected rollouts leave it (rows None: every rollout was rejected)."""
    cc = cfg.correction
    corrected = correct(s.old.cpu(), s.batch.rollout_logprobs, s.batch.response_mask,
                        s.batch.rollout_index, weight=cc.weight, cap=cc.cap, mask_mode=cc.mask,
                        band=tuple(cc.band), reject=tuple(cc.reject) if cc.reject else None)
    s.train_mask, s.is_weights = corrected.mask, corrected.is_weights
    if corrected.metrics["correction/rejected_rollouts"]:
        keep = (s.train_mask.any(1) | ~s.batch.response_mask.any(1)).nonzero().squeeze(1)
        if not keep.numel():
            return None, corrected
        s = s.keep(keep)
    d = s.ids.device
    s.mask = s.train_mask.to(d)
    s.is_weights = None if s.is_weights is None else s.is_weights.to(d)
    return s, corrected


class Gap:
    """Mean and max |engine logprob - trainer logprob| over trained tokens, before any step."""

    def __init__(self) -> None:
        self.sum, self.max, self.n = 0.0, 0.0, 0

    def add(self, lp: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> None:
        d = (lp.detach() - behaviour).abs()[mask.bool()]
        if d.numel():
            self.sum, self.n, self.max = (self.sum + float(d.sum()), self.n + d.numel(),
                                          max(self.max, float(d.max())))

    def result(self) -> dict[str, float] | None:
        return {"mean": self.sum / self.n, "max": self.max} if self.n else None


def mini_batch_step(model, optimizer, scheduler, s: StepRows, mb, fwd: Forward, cfg: TrainConfig,
                    dp: DataParallel, ref_model, gap: Gap | None,
                    stop: Callable[[], bool] | None = None) -> tuple[float, float, dict]:
    """One optimizer update on mini-batch `mb` -> (loss, grad norm, metrics): the plain sum of
    its micro-batches' policy_loss, backward each (DDP: all-reduce once, on the last), clip,
    AdamW step, lr schedule. `gap`: measured on these micro-batches before the step. `stop`:
    asked before each micro-batch (UpdateStopped, the gradients dropped)."""
    lc = cfg.loss
    optimizer.zero_grad(set_to_none=True)
    total, sums = 0.0, {}
    for j, micro in enumerate(mb.micro_batches):
        _check(stop, optimizer)
        last = j == len(mb.micro_batches) - 1
        sync = model.no_sync() if dp.enabled and not last else contextlib.nullcontext()
        with sync:  # the forward too: DDP arms its all-reduce in the forward pass
            rd = micro.rows.to(s.ids.device)
            lp, ent, pk, computed, padded = fwd(model, s, micro.rows, entropy=lc.entropy_coef > 0)
            if gap is not None:
                gap.add(lp, s.behaviour[rd], s.mask[rd])
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref = fwd(ref_model, s, micro.rows, packed=pk, phase="reference")[0]
            with fwd.phases.phase("loss"):
                loss, m = policy_loss(
                    lp, s.old[rd], s.adv[rd], RowWeights(s.mask[rd], micro.row_scales.to(rd.device)),
                    clip_low=lc.clip_low, clip_high=lc.clip_high, dual_clip=lc.dual_clip,
                    is_weights=None if s.is_weights is None else s.is_weights[rd],
                    ref_logprobs=ref, kl_coef=lc.kl_coef, kl_estimator=lc.kl_estimator,
                    entropy=ent, entropy_coef=lc.entropy_coef,
                )
            with fwd.phases.phase("backward"):
                loss.backward()
        total += float(loss.detach())
        m = {**m, "tokens_computed": computed, "tokens_padded": padded}
        # pg_loss, weight_mass and token counts add up over micro-batches; the rest are weighted
        # means within the micro-batch, so they add up weighted by its mass.
        mass = float(m["weight_mass"])
        for k, v in m.items():
            plain = k in ADDITIVE_METRICS or k in TOKEN_METRICS
            sums[k] = sums.get(k, 0.0) + (float(v) if plain else float(v) * mass)
    if dp.enabled:  # each rank's losses carry a factor W (minibatch.py): sum, then / W
        keys = sorted(sums)
        summed = sum_over_ranks([total, *(sums[k] for k in keys)], dp)
        total, sums = summed[0] / dp.world_size, dict(zip(keys, summed[1:], strict=True))
    metrics = update_metrics(sums, s, mb, dp.world_size)
    with fwd.phases.phase("optimizer"):
        grad_norm = clip_grad_norm(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return total, grad_norm, metrics


def update_metrics(sums: dict[str, float], s: StepRows, mb, world_size: int) -> dict[str, float]:
    """The update's metrics from its micro-batch sums, and each rollout's share of the update
    (1/R each in rollout-mean, however many rows; min, max, and x R within this update)."""
    mass, W = sums.get("weight_mass", 0.0), world_size
    means = {k: (v if k in TOKEN_METRICS else v / W if k in ADDITIVE_METRICS
                 else v / mass if mass else 0.0) for k, v in sums.items()}
    per_rollout = rollout_mass(s.train_mask[mb.rows], s.batch.rollout_index[mb.rows], mb.row_scales)
    lo, hi = (float(per_rollout.min()), float(per_rollout.max())) if per_rollout.numel() else (0.0, 0.0)
    means["rollout_mass_min"], means["rollout_mass_max"] = lo, hi
    means["n_rollouts"] = float(per_rollout.numel())
    means["rollout_mass_x_R_min"] = lo * per_rollout.numel()
    means["rollout_mass_x_R_max"] = hi * per_rollout.numel()
    return means


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
    stop: Callable[[], bool] | None = None,
    phases: Phases | None = None,
) -> list[UpdateResult]:
    """PPO epochs over mini-batches of whole rollouts; the loss of a mini-batch is the plain sum
    of its micro-batch losses (weights computed once per mini-batch, see minibatch.py).

        rows   = the batch on the model's device
        old    = the engine's logprobs, or (correction.old trainer, or none recorded) the policy's
                 own before the first update; correction: its mask and weights fixed for the step,
                 rejected rollouts out
        for epoch, for mini-batch (the same plan every epoch): one optimizer update

    Data parallel (`dp` enabled, `model` wrapped in DDP): every rank gets the same batch and plan;
    this rank trains its shard's micro-batches; DDP all-reduces once per mini-batch, so the update
    equals the one-process update. Metrics are summed over ranks. measure_gap (the rollouts came
    from these very weights): the first update's result carries mean and max |engine logprob -
    trainer logprob| over its trained tokens (this rank's). `stop`: module docstring (not asked
    under DDP: every rank would have to stop at the same micro-batch). `phases`: where the seconds
    of each phase go (a new Phases when None); the first result carries them (`times`)."""
    stop = None if dp.enabled else stop
    s = StepRows.of(batch, advantages, next(model.parameters()).device)
    fwd = Forward(model, cfg, phases)
    corrected = None
    s.old = s.behaviour
    if s.behaviour is None or cfg.correction.old == "trainer":
        s.old = proximal_logprobs(model, s, fwd, cfg, stop)
        if cfg.correction.old == "trainer" and s.behaviour is not None:
            s, corrected = apply_correction(s, cfg)
            if s is None:  # every rollout rejected: no update
                return [UpdateResult(0.0, 0.0, {}, None, corrected.metrics, fwd.phases.metrics())]
    model.train()
    mini_batches = plan(s, fwd, cfg, dp.world_size, dp.rank)  # a function of the rows alone
    results: list[UpdateResult] = []
    try:
        for _epoch in range(cfg.optim.ppo_epochs):
            for mb in mini_batches:
                first = not results
                gap = Gap() if first and measure_gap and s.behaviour is not None else None
                loss, grad_norm, metrics = mini_batch_step(model, optimizer, scheduler, s, mb, fwd, cfg,
                                                           dp, ref_model, gap, stop if first else None)
                results.append(UpdateResult(loss, grad_norm, metrics, gap and gap.result(),
                                            corrected.metrics if first and corrected else None))
    finally:
        model.eval()
    if results:
        results[0].times = fwd.phases.metrics()
    return results
