"""`tracetrain sft`: fine-tune the policy on the exact tokens of chosen rollouts of earlier runs.

    chosen = select(rollouts, min_reward=1.0)          # or best_per_group=k
    chosen = dedupe(chosen)                            # the same turns (ids) trained once
    batch = sft_rows(chosen, cfg, pad_token_id)        # the RL path's rows and masks
    losses = fine_tune(model, batch, cfg, epochs=3, lr=1e-5)

The rows are `aggregate`'s with the run's config (level, lengths, roles.train): the trained
tokens are exactly the policy's own responses as the engine produced them, nothing re-tokenised.
The loss is the negative log-likelihood of those tokens with the loss mode's token weights over
each mini-batch of whole rollouts (rollout-mean: each rollout weighs 1/R, however many rows):

    L = - sum_{i,t} w[i,t] * log p(x[i,t] | x[i,<t])

Pure but for the model it trains: the command (cli.py) reads the runs' stores and writes the
result as a `policy/` folder an RL run starts from (`model.kind: pretrained`, `model.path`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from tracetrain.learn.optim import clip_grad_norm
from tracetrain.learn.update import Forward, StepRows
from tracetrain.objective.minibatch import plan_step
from tracetrain.rows.aggregate import aggregate
from tracetrain.rows.batch import TrainingBatch
from tracetrain.types import Rollout, UsageError


def select(rollouts: Sequence[Rollout], *, min_reward: float | None = None,
           best_per_group: int | None = None, max_version: int | None = None) -> list[Rollout]:
    """Succeeded rollouts with a reward: those >= min_reward, and/or the best_per_group highest
    of each group (ties: the earlier rollout), in their order; with max_version, only rollouts
    every turn of which a policy of at most that version made (0: the untrained policy's)."""
    if min_reward is None and best_per_group is None:
        raise ValueError("choose the rollouts: min_reward and/or best_per_group")
    scored = [r for r in rollouts if str(getattr(r.state, "value", r.state)) == "succeeded"
              and r.reward is not None]
    if max_version is not None:
        scored = [r for r in scored if all(t.model_version is not None and t.model_version <= max_version
                                           for t in r.turns)]
    if min_reward is not None:
        scored = [r for r in scored if r.reward >= min_reward]
    if best_per_group is not None:
        keep, by_group = set(), {}
        for k, r in enumerate(scored):
            by_group.setdefault(r.group_id, []).append((-r.reward, k))
        for members in by_group.values():
            keep.update(k for _, k in sorted(members)[:best_per_group])
        scored = [r for k, r in enumerate(scored) if k in keep]
    return scored


def dedupe(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """The first of rollouts whose turns hold the same prompt and response ids."""
    seen, out = set(), []
    for r in rollouts:
        key = tuple((tuple(t.prompt_ids), tuple(t.response_ids)) for t in r.turns)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def sft_rows(rollouts: Sequence[Rollout], cfg: Any, pad_token_id: int) -> TrainingBatch:
    """The rows the RL path builds for these rollouts (aggregate with the run's config); a
    UsageError if none is left (the chosen rollouts do not fit the config's lengths)."""
    ac = cfg.aggregate
    batch, _ = aggregate(rollouts, level=ac.level, max_prompt_length=ac.max_prompt_length,
                         max_response_length=ac.max_response_length, pad_token_id=pad_token_id,
                         overlong=ac.overlong, train_roles=cfg.roles.train)
    if batch.n_rows == 0:
        raise UsageError("no rows to fine-tune on: every chosen rollout was dropped (too long, "
                         "or no trained tokens)")
    return batch


def fine_tune(model: torch.nn.Module, batch: TrainingBatch, cfg: Any, *, epochs: int, lr: float,
              seed: int = 0) -> list[float]:
    """AdamW on L (module docstring), optim.mini_batches updates per epoch over a shuffled order
    of whole rollouts; returns each epoch's mean loss."""
    opt, params, fwd = _optimizer(model, lr), _params(model), Forward(model, cfg)
    s = _rows(batch, model)
    rng = random.Random(seed)
    losses = []
    model.train()
    for _ in range(epochs):
        order = list(range(batch.n_rollouts))
        rng.shuffle(order)
        rank = torch.empty(batch.n_rollouts, dtype=torch.long)
        rank[torch.tensor(order)] = torch.arange(batch.n_rollouts)
        plan = plan_step(batch.response_mask, rank[batch.rollout_index],
                         n_mini_batches=min(cfg.optim.mini_batches, batch.n_rollouts),
                         micro_batch_tokens=fwd.budget, mode=cfg.loss.mode,
                         norm_length=cfg.loss.norm_length, row_tokens=batch.attention_mask.sum(1),
                         micro_costs=fwd.costs(s))
        total = sum(_update(model, s, mb, fwd, opt, params, cfg.optim.grad_clip) for mb in plan)
        losses.append(total / len(plan))
    model.eval()
    return losses


def fine_tune_steps(model: torch.nn.Module, batch: TrainingBatch, cfg: Any, *, steps: int,
                    batch_size: int, lr: float, seed: int = 0) -> list[float]:
    """`steps` AdamW updates on L, each over `batch_size` whole rollouts drawn at random (all of
    them when there are fewer; each rollout weighs 1/batch_size under rollout-mean); returns each
    step's loss."""
    opt, params, fwd = _optimizer(model, lr), _params(model), Forward(model, cfg)
    rng = random.Random(seed)
    k = min(batch_size, batch.n_rollouts)
    losses = []
    model.train()
    for _ in range(steps):
        chosen = torch.zeros(batch.n_rollouts, dtype=torch.bool)
        chosen[rng.sample(range(batch.n_rollouts), k)] = True
        s = _rows(batch.select_rows(chosen[batch.rollout_index].nonzero().squeeze(1)), model)
        (mb,) = plan_step(s.batch.response_mask, s.batch.rollout_index, n_mini_batches=1,
                          micro_batch_tokens=fwd.budget, mode=cfg.loss.mode,
                          norm_length=cfg.loss.norm_length,
                          row_tokens=s.batch.attention_mask.sum(1), micro_costs=fwd.costs(s))
        losses.append(_update(model, s, mb, fwd, opt, params, cfg.optim.grad_clip))
    model.eval()
    return losses


def _params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    from tracetrain.models import lora

    return lora.trainable(model)  # the adapter's under LoRA, else all


def _optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    from tracetrain.learn.optim import adamw

    return adamw(_params(model), lr=lr, weight_decay=0.0)


def _rows(batch: TrainingBatch, model: torch.nn.Module) -> StepRows:
    """The rows as the RL update reads them (no advantages: the loss is the likelihood's)."""
    dev = next(model.parameters()).device
    return StepRows.of(batch, torch.zeros(batch.response_mask.shape), dev)


def _update(model, s: StepRows, mb, fwd: Forward, opt, params, grad_clip: float) -> float:
    """One AdamW step on mini-batch `mb`: its micro-batches' logprobs as the RL update computes them
    (packed, shared prompts once, under trainer.precision: learn/update.Forward), weighted by the
    mini-batch's scales; its loss."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for micro in mb.micro_batches:
        lp, *_ = fwd(model, s, micro.rows)
        w = s.mask[micro.rows.to(s.mask.device)].to(lp.dtype) * micro.row_scales.to(lp.device)[:, None]
        loss = -(w * lp).sum()
        loss.backward()
        total += float(loss.detach())
    clip_grad_norm(params, grad_clip)
    opt.step()
    return total
