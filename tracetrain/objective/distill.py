"""On-policy distillation: a teacher's per-token term as credit.

For each taught token t of row i (a response token of a turn whose role the teacher teaches),
λ_T[i,t] = log π_teacher(y_t | its context), scored by the teacher at temperature 1
(engines/score.py), and λ_S[i,t] the logprob the engine recorded when it sampled y_t (the
sampling distribution's: batch.rollout_logprobs):

    d[i,t] = λ_T[i,t] − λ_S[i,t]                 (minus the reverse-KL term log π_S/π_T)
    A[i,t] = with_reward · A_RL[i,t] + coef · taught[i,t] · d[i,t]

A_RL is the reward-based advantage (objective/credit.py: one per rollout broadcast to its tokens,
or one per turn), with_reward ∈ {0, 1}. Only advantages change: the token weights w[i,t] do not,
so each rollout still weighs 1/R (1/R_p per policy) and its trained tokens share that. d[i,t]
depends on the token alone (its context ids and its id), never on how its rollout was cut into
rows or mini-batches, so A keeps split, partition and role invariance (docs/invariants.md
invariants 1, 3, 7). A teacher equal to the sampling policy gives d = 0 on every token.

Metrics: distill/reverse_kl, the mean over taught tokens of −d (each token an unbiased sample of
KL(π_S ‖ π_T) at its context); distill/taught_tokens; distill/adv_mean (of coef · d).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tracetrain.rows.batch import TrainingBatch

# rollout id -> turn index -> the teacher's logprob of each of the turn's response tokens
TeacherLogprobs = Mapping[str, Mapping[int, Sequence[float]]]


def teacher_logprobs(batch: TrainingBatch, teacher: TeacherLogprobs,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(λ_T [rows, S] float32, taught [rows, S] bool): each row's trained tokens of the turns in
    `teacher` (batch.turn_spans: a span (k, start, n) holds the first n response tokens of turn
    k); 0 and False elsewhere. ValueError when a turn's scores are fewer than its tokens."""
    if batch.turn_spans is None:
        raise ValueError("teacher_logprobs needs batch.turn_spans (a batch built by aggregate)")
    lp = torch.zeros(batch.n_rows, batch.response_length, dtype=torch.float32)
    taught = torch.zeros(batch.n_rows, batch.response_length, dtype=torch.bool)
    for i, (rid, spans) in enumerate(zip(batch.rollout_ids, batch.turn_spans, strict=True)):
        turns = teacher.get(rid, {})
        for k, start, n in spans:
            scores = turns.get(k)
            if scores is None:
                continue
            if len(scores) < n:
                raise ValueError(f"rollout {rid!r} turn {k}: the teacher scored {len(scores)} "
                                 f"tokens of the {n} trained")
            lp[i, start : start + n] = torch.tensor(list(scores[:n]), dtype=torch.float32)
            taught[i, start : start + n] = True
    return lp, taught & batch.response_mask


def token_level(batch: TrainingBatch, advantages: torch.Tensor) -> torch.Tensor:
    """[rows, S] float32: `advantages` as one value per token ([n_rollouts]: each rollout's on
    its rows' trained tokens; [rows, S]: as given), 0 on tokens that do not train."""
    if advantages.dim() == 2:
        return advantages.float() * batch.response_mask
    return advantages.float()[batch.rollout_index][:, None] * batch.response_mask


def distill_advantages(batch: TrainingBatch, advantages: torch.Tensor, teacher: TeacherLogprobs,
                       *, coef: float, with_reward: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """([rows, S] float32 A of the module docstring, metrics), from the reward-based
    `advantages` ([n_rollouts] or [rows, S]) and the teacher's scores of the taught turns."""
    if batch.rollout_logprobs is None:
        raise ValueError("distillation needs the sampled tokens' logprobs, and a turn of the "
                         "batch has none (its engine recorded none)")
    lp_t, taught = teacher_logprobs(batch, teacher)
    d = torch.where(taught, lp_t - batch.rollout_logprobs.float(), 0.0)
    base = token_level(batch, advantages) if with_reward else torch.zeros_like(d)
    out = base + coef * d
    n = int(taught.sum())
    d64 = d[taught].double()
    metrics = {"distill/taught_tokens": float(n),
               "distill/reverse_kl": float(-d64.mean()) if n else 0.0,
               "distill/adv_mean": float(coef * d64.mean()) if n else 0.0}
    return out, metrics
