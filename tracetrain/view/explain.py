"""What the trainer did with each token of one step's rollouts, recomputed from the traces.

    step = explain_step(rollouts, cfg, tokenizer)   # aggregate -> credit -> plan, as the trainer
    step.summary[rollout_id]   # Explained: rows, breaks, advantage, loss mass, mini-batch, status
    step.rows(rollout_id)      # [TokenRow]: every token of its rows, kind, weight, advantage, logprob
                               # (with a teacher: its logprob, the distillation and reward parts)

The rows are the step's rollouts aggregated with the run's config (aggregate.level, lengths,
roles.train), credited (advantage.estimator, failed_rollouts) and planned into mini-batches as
update.ppo_update plans them (optim.mini_batches, micro_batch_tokens, loss.mode), so:

    weight[i, t] = m[i, t] * s_i        (s_i: the mini-batch's row scale, weights.row_scales)
    mass(r)      = sum_{i in r, t} weight[i, t]      (1/R in rollout-mean, whatever the rows)

A rollout not in the rows says why (`status`): dropped by aggregation (see its metrics) or
excluded by credit (failed or timed out). Pure: no I/O; `tokenizer` only decodes break snippets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tracetrain.objective.credit import batch_credit
from tracetrain.objective.distill import (
    TeacherLogprobs,
    distill_advantages,
    teacher_logprobs,
    token_level,
)
from tracetrain.objective.minibatch import MiniBatch, plan_step
from tracetrain.rows.aggregate import aggregate
from tracetrain.rows.batch import TrainingBatch
from tracetrain.rows.drift import DriftBreak
from tracetrain.types import Rollout

TRAINED, DROPPED, EXCLUDED = "trained", "dropped by aggregation", "excluded (failed or timed out)"


@dataclass
class TokenRow:
    """One training row of a rollout: its tokens as the trainer forwarded them (padding removed).

    Per token (lists of len(ids)): kind "prompt" | "observation" | "trained"; weight in the loss
    (0 unless trained); advantage and engine logprob (None unless trained); the turn whose
    response the token is (None for prompt and observation tokens). `prompt_offset`: prompt
    tokens cut from the left of the row's first turn's prompt (aggregate.max_prompt_length), so
    token j of the prompt is position prompt_offset + j of that turn's prompt_ids."""

    index: int
    first_turn: int
    ids: list[int]
    n_prompt: int
    prompt_offset: int
    kind: list[str]
    weight: list[float]
    advantage: list[float | None]
    logprob: list[float | None]
    turn: list[int | None]
    # with a teacher (config `distill`; None elsewhere): its logprob of the token, the token's
    # distillation advantage coef · (teacher − engine logprob), and the reward-based one (0 when
    # distill.with_reward is false: not trained on); advantage is what the token trained with
    teacher_logprob: list[float | None] = field(default_factory=list)
    distill: list[float | None] = field(default_factory=list)
    reward_advantage: list[float | None] = field(default_factory=list)


@dataclass
class Explained:
    """One rollout's place in its step: status (TRAINED, DROPPED or EXCLUDED), its rows and breaks,
    its advantage (a float, or {turn: advantage} with a turn-level estimator), its loss mass and
    the mini-batch (0-based) it was trained in."""

    rollout_id: str
    status: str
    n_rows: int = 0
    trained_tokens: int = 0
    breaks: list[DriftBreak] = field(default_factory=list)
    advantage: float | dict[int, float] | None = None
    mass: float | None = None
    mini_batch: int | None = None


@dataclass
class StepExplained:
    summary: dict[str, Explained]
    metrics: dict[str, float]  # aggregate's
    n_rollouts: int  # rollouts trained in the step
    n_mini_batches: int
    mini_batch_rollouts: list[int]  # rollouts per mini-batch
    mode: str
    estimator: str
    batch: TrainingBatch | None  # the credited rows (None: nothing trained)
    advantages: torch.Tensor | None
    plan: list[MiniBatch]
    prompt_lengths: dict[tuple[str, int], int]  # (rollout, turn) -> len(prompt_ids)
    # with a teacher, each [rows, S]: its logprobs, the taught tokens (bool), coef · d, and the
    # reward-based advantages
    teacher: tuple[torch.Tensor, ...] | None = None

    def rows(self, rollout_id: str) -> list[TokenRow]:
        """The rollout's rows token by token ([] if it was not trained)."""
        b = self.batch
        if b is None or rollout_id not in b.rollouts:
            return []
        k = b.rollouts.index(rollout_id)
        scale = {}
        for mb in self.plan:
            scale.update(zip(mb.rows.tolist(), mb.row_scales.tolist(), strict=True))
        P = b.prompt_length
        out = []
        for i in (b.rollout_index == k).nonzero().squeeze(1).tolist():
            att = b.attention_mask[i].bool()
            ids = b.input_ids[i][att].tolist()
            n_prompt = int(att[:P].sum())
            n_resp = len(ids) - n_prompt
            mask = b.response_mask[i, :n_resp].tolist()
            turn_of: list[int | None] = [None] * n_resp
            for t, start, n in (b.turn_spans[i] if b.turn_spans is not None else []):
                turn_of[start:start + n] = [t] * n
            if self.advantages is None:
                adv = [None] * n_resp
            elif self.advantages.dim() == 2:
                adv = self.advantages[i, :n_resp].tolist()
            else:
                adv = [float(self.advantages[k])] * n_resp
            lp = [None] * n_resp if b.rollout_logprobs is None else b.rollout_logprobs[i, :n_resp].tolist()
            taught = self._taught(i, n_resp, n_prompt)
            first = int(b.turn_index[i])
            s = scale.get(i, 0.0)
            out.append(TokenRow(
                index=i, first_turn=first, ids=ids, n_prompt=n_prompt,
                prompt_offset=self.prompt_lengths.get((rollout_id, first), n_prompt) - n_prompt,
                kind=["prompt"] * n_prompt + ["trained" if m else "observation" for m in mask],
                weight=[0.0] * n_prompt + [s if m else 0.0 for m in mask],
                advantage=[None] * n_prompt + [a if m else None for a, m in zip(adv, mask, strict=True)],
                logprob=[None] * n_prompt + [x if m else None for x, m in zip(lp, mask, strict=True)],
                turn=[None] * n_prompt + [t if m else None for t, m in zip(turn_of, mask, strict=True)],
                **taught,
            ))
        return out

    def _taught(self, i: int, n_resp: int, n_prompt: int) -> dict[str, list[float | None]]:
        """Row i's teacher_logprob, distill and reward_advantage lists ({} without a teacher)."""
        if self.teacher is None:
            return {}
        lp_t, taught, dist, reward = (x[i, :n_resp].tolist() for x in self.teacher)
        mask = self.batch.response_mask[i, :n_resp].tolist()
        pad: list[float | None] = [None] * n_prompt

        def on(values: list[float], where: list[bool]) -> list[float | None]:
            return pad + [v if w else None for v, w in zip(values, where, strict=True)]

        return {"teacher_logprob": on(lp_t, taught), "distill": on(dist, taught),
                "reward_advantage": on(reward, mask)}


def explain_step(rollouts: Sequence[Rollout], cfg: Any, tokenizer=None,
                 teacher: TeacherLogprobs | None = None) -> StepExplained:
    """The step's rows, credit and plan for `rollouts` (one step's finished rollouts), with the
    run's `TrainConfig` (a store without config.json: `TrainConfig()`'s defaults; not imported
    here: the config reaches the verl integration's keys, and this stage stays pure). `teacher`:
    the teacher's scores (run/teacher.teacher_scores) when cfg.distill is set: the advantages
    are then objective/distill.py's, as the run trained."""
    ac, est, oc = cfg.aggregate, cfg.advantage, cfg.optim
    train_roles = cfg.roles.train
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    batch, metrics, breaks = aggregate(
        rollouts, level=ac.level, max_prompt_length=ac.max_prompt_length,
        max_response_length=ac.max_response_length, pad_token_id=pad, tokenizer=tokenizer,
        overlong=ac.overlong, return_breaks=True, train_roles=train_roles)
    summary = {r.rollout_id: Explained(r.rollout_id, DROPPED) for r in rollouts}
    for b in breaks:
        summary[b.rollout_id].breaks.append(b)
    lengths = {(r.rollout_id, k): len(t.prompt_ids) for r in rollouts for k, t in enumerate(r.turns)}
    base = dict(metrics=metrics, mode=cfg.loss.mode, estimator=est.estimator, prompt_lengths=lengths)
    if not batch.rollouts:
        return StepExplained(summary, n_rollouts=0, n_mini_batches=0, mini_batch_rollouts=[],
                             batch=None, advantages=None, plan=[], **base)
    kept, adv, _ = batch_credit(
        batch, rollouts, estimator=est.estimator, train_roles=train_roles, gamma=est.gamma,
        step_weight=est.step_weight, failed_rollouts=est.failed_rollouts, others=cfg.other_policies_roles)
    for rid in set(batch.rollouts) - set(kept.rollouts):
        summary[rid].status = EXCLUDED
    if not kept.rollouts:
        return StepExplained(summary, n_rollouts=0, n_mini_batches=0, mini_batch_rollouts=[],
                             batch=None, advantages=None, plan=[], **base)
    plan = plan_step(  # as update.ppo_update plans the step (every epoch plans the same)
        kept.response_mask, kept.rollout_index, n_mini_batches=min(oc.mini_batches, kept.n_rollouts),
        micro_batch_tokens=oc.micro_batch_tokens, mode=cfg.loss.mode, norm_length=cfg.loss.norm_length,
        row_tokens=kept.attention_mask.sum(1))
    taught, trained_with = None, adv
    if getattr(cfg, "distill", None) is not None and teacher is not None:
        reward = token_level(kept, adv) if cfg.distill.with_reward else torch.zeros(
            kept.response_mask.shape)
        trained_with, _ = distill_advantages(kept, adv, teacher, coef=cfg.distill.coef,
                                             with_reward=cfg.distill.with_reward)
        taught = (*teacher_logprobs(kept, teacher), trained_with - reward, reward)
    T = kept.response_mask.sum(1).to(torch.float64)
    mass = torch.zeros(kept.n_rollouts, dtype=torch.float64)
    where = torch.full((kept.n_rollouts,), -1, dtype=torch.int64)
    for j, mb in enumerate(plan):
        ro = kept.rollout_index[mb.rows]
        mass.index_add_(0, ro, T[mb.rows] * mb.row_scales.to(torch.float64))
        where[ro] = j
    n_rows = torch.bincount(kept.rollout_index, minlength=kept.n_rollouts).tolist()
    trained = torch.zeros(kept.n_rollouts, dtype=torch.float64).index_add_(0, kept.rollout_index, T)
    for k, rid in enumerate(kept.rollouts):
        e = summary[rid]
        e.status, e.n_rows, e.trained_tokens = TRAINED, n_rows[k], int(trained[k])
        e.mass, e.mini_batch = float(mass[k]), int(where[k])
        if adv.dim() == 2:  # per turn: each turn's tokens carry its own
            rows = (kept.rollout_index == k).nonzero().squeeze(1).tolist()
            e.advantage = {t: float(adv[i, start]) for i in rows for t, start, _ in kept.turn_spans[i]}
        else:
            e.advantage = float(adv[k])
    return StepExplained(summary, n_rollouts=kept.n_rollouts, n_mini_batches=len(plan),
                         mini_batch_rollouts=[mb.n_rollouts for mb in plan], batch=kept,
                         advantages=trained_with, plan=plan,
                         teacher=taught, **base)
