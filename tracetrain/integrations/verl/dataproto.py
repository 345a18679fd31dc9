"""TrainingBatch + advantages <-> verl DataProto, laid out so that verl's mini-batches are ours.

The rows keep tracetrain's layout, which is verl's: `prompts` [N, P] left-padded, `responses`
[N, S] right-padded, input_ids / attention_mask / position_ids over P + S, `response_mask` [N, S]
(int64 0/1: 0 on observation tokens merged into a row, as verl's multi-turn agent loop does).
Keys written:

    input_ids, attention_mask, position_ids, prompts, responses, response_mask
    old_log_probs        [N, S] the ratio's denominator (the rollout's logprobs unless given)
    rollout_log_probs    [N, S] the engine's logprobs, when the batch has them
    ref_log_prob         [N, S] when given (KL term)
    advantages           [N, S] the row's rollout advantage on every column, or each token's own
                         (turn-level credit: meta_info token_advantages); the loss weights it
    rollout_is_weights   [N, S] tracetrain's token weights w (loss.TOKEN_WEIGHTS; see loss.py)
    row_index            [N] the row in the TrainingBatch, -1 on padding rows
    turn_index, reward, model_version   [N] per row (reward: the rollout's, NaN if none)
    non-tensor: uid (group id, as verl's GRPO uses it), rollout_id, rollout_state
    meta_info: temperature, mini_batch_size (rows of one verl mini-batch, all dp ranks),
               token_advantages (whether advantages were given per token)

Layout. verl's actor update (0.9.1) chunks the N rows into dp_size equal contiguous parts, one per
rank, then each rank cuts its part into mini-batches of m = mini_batch_size / dp_size rows, in
order (shuffle off). So verl mini-batch k is rows [d*K*m + k*m, d*K*m + (k+1)*m) of every rank d
(K mini-batches). We put tracetrain mini-batch k (from `plan_step`: whole rollouts, weights computed
on it) there: its rows are spread over the ranks balanced by token count, and every (rank,
mini-batch) slot is filled up to m rows (a multiple of `rows_multiple`, verl's fixed micro-batch
size) with padding rows: one pad token of prompt, nothing trained, weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from verl import DataProto

from tracetrain.integrations.verl.loss import TOKEN_WEIGHTS
from tracetrain.objective.minibatch import balanced_bins, plan_step
from tracetrain.rows.batch import TrainingBatch


@dataclass
class Layout:
    order: torch.Tensor  # [K * dp_size * m] int64: the TrainingBatch row at each position, -1 = pad
    mini_batch_size: int  # dp_size * m: rows of one verl mini-batch
    n_mini_batches: int  # K
    dp_size: int


def verl_layout(
    mini_batches: list[torch.Tensor],
    row_cost: torch.Tensor,
    *,
    dp_size: int = 1,
    rows_multiple: int = 1,
) -> Layout:
    """Positions of the rows so that verl's k-th mini-batch holds exactly `mini_batches[k]`.

    mini_batches: the row indices of each tracetrain mini-batch; row_cost [rows]: what a row costs
    (its attention tokens), to balance the ranks. See the module docstring.
    """
    for name, v in (("dp_size", dp_size), ("rows_multiple", rows_multiple)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not mini_batches:
        raise ValueError("no mini-batches to lay out")
    shards = []  # shards[k][d]: rows of mini-batch k on rank d
    for rows in mini_batches:
        rows = rows.tolist()
        bins = balanced_bins([int(row_cost[r]) for r in rows], dp_size)
        shards.append([[rows[p] for p in b] for b in bins])
    longest = max(len(s) for mb in shards for s in mb)
    m = max(1, -(-longest // rows_multiple)) * rows_multiple
    order = torch.full((dp_size, len(mini_batches), m), -1, dtype=torch.int64)
    for k, mb in enumerate(shards):
        for d, rows in enumerate(mb):
            order[d, k, : len(rows)] = torch.tensor(rows, dtype=torch.int64)
    return Layout(order.reshape(-1), dp_size * m, len(mini_batches), dp_size)


def _take(x: torch.Tensor, order: torch.Tensor, fill) -> torch.Tensor:
    """x[order] with `fill` where order is -1."""
    out = x[order.clamp(min=0)].clone()
    out[order < 0] = fill
    return out


def to_dataproto(
    batch: TrainingBatch,
    advantages: torch.Tensor,
    *,
    mode: str = "rollout-mean",
    norm_length: float | None = None,
    n_mini_batches: int = 1,
    dp_size: int = 1,
    rows_multiple: int = 1,
    old_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    pad_token_id: int = 0,
    temperature: float = 1.0,
) -> DataProto:
    """The DataProto of one step (see the module docstring for keys and layout).

    advantages [n_rollouts]: one per rollout (`advantage.batch_advantages`), or [rows, S]: one
    per token (turn-level credit, `credit.batch_credit`). The token weights of each mini-batch
    follow `mode` / `norm_length`, computed on the whole mini-batch before verl splits it.
    old_log_probs [rows, S] default to the batch's rollout logprobs.
    """
    n, S, P = batch.n_rows, batch.response_length, batch.prompt_length
    if n == 0:
        raise ValueError("the batch has no rows")
    shapes = ((batch.n_rollouts,), (n, S))
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in shapes:
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages)
        raise ValueError(
            f"advantages must have shape ({batch.n_rollouts},) (one per rollout) or ({n}, {S}) "
            f"(one per token), got {got}"
        )
    per_token = advantages.dim() == 2
    if P < 1 or bool((batch.attention_mask[:, :P].sum(1) == 0).any()):
        k = int((batch.attention_mask[:, :P].sum(1) == 0).nonzero()[0]) if P else 0
        raise ValueError(f"row {k} has no prompt token; verl needs at least one per row")
    old = old_log_probs if old_log_probs is not None else batch.rollout_logprobs
    if old is None:
        raise ValueError(
            "no old_log_probs: the batch has no rollout logprobs; compute them with the actor "
            "(compute_log_prob) and pass old_log_probs"
        )
    for name, x in (("old_log_probs", old), ("ref_log_probs", ref_log_probs)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != (n, S)):
            raise ValueError(f"{name} must have shape ({n}, {S}), got {getattr(x, 'shape', x)}")

    mask = batch.response_mask
    plan = plan_step(
        mask,
        batch.rollout_index,
        n_mini_batches=min(n_mini_batches, batch.n_rollouts),
        mode=mode,
        norm_length=norm_length,
        row_tokens=batch.attention_mask.sum(1),
    )
    scales = torch.zeros(n, dtype=torch.float32)
    for mb in plan:
        scales[mb.rows] = mb.row_scales
    weights = mask.float() * scales[:, None]
    layout = verl_layout(
        [mb.rows for mb in plan],
        batch.attention_mask.sum(1),
        dp_size=dp_size,
        rows_multiple=rows_multiple,
    )
    order = layout.order

    pad_ids = torch.full((P + S,), pad_token_id, dtype=batch.input_ids.dtype)
    pad_att = torch.zeros(P + S, dtype=batch.attention_mask.dtype)
    pad_att[P - 1] = 1  # one prompt token, so verl finds a prompt in every row
    input_ids = _take(batch.input_ids, order, pad_ids)
    token_adv = (advantages.float() if per_token
                 else advantages.float()[batch.rollout_index][:, None].expand(n, S))
    tensors = {
        "input_ids": input_ids,
        "attention_mask": _take(batch.attention_mask, order, pad_att),
        "position_ids": _take(batch.position_ids, order, 0),
        "prompts": input_ids[:, :P],
        "responses": input_ids[:, P:],
        "response_mask": _take(mask.long(), order, 0),
        "old_log_probs": _take(old.float(), order, 0.0),
        "advantages": _take(token_adv, order, 0.0),
        TOKEN_WEIGHTS: _take(weights, order, 0.0),
        "row_index": order.clone(),
        "turn_index": _take(batch.turn_index, order, -1),
        "reward": _take(batch.rewards.float()[batch.rollout_index], order, float("nan")),
    }
    if batch.rollout_logprobs is not None:
        tensors["rollout_log_probs"] = _take(batch.rollout_logprobs.float(), order, 0.0)
    if ref_log_probs is not None:
        tensors["ref_log_prob"] = _take(ref_log_probs.float(), order, 0.0)
    if batch.model_version is not None:
        tensors["model_version"] = _take(batch.model_version, order, -1)

    def column(values: list[str]) -> np.ndarray:
        return np.array([values[i] if i >= 0 else "" for i in order.tolist()], dtype=object)

    states = batch.rollout_states or [""] * batch.n_rollouts
    non_tensors = {
        "uid": column(batch.group_ids),
        "rollout_id": column(batch.rollout_ids),
        "rollout_state": column([states[r] for r in batch.rollout_index.tolist()]),
    }
    meta = {"temperature": float(temperature), "mini_batch_size": layout.mini_batch_size,
            "token_advantages": per_token}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


def from_dataproto(proto: DataProto) -> tuple[TrainingBatch, torch.Tensor, torch.Tensor]:
    """(batch, advantages, token weights [rows, S]) back from `to_dataproto`'s output: padding
    rows dropped, rows in their TrainingBatch order; advantages as they were given: [n_rollouts],
    or [rows, S] when per token."""
    t = proto.batch
    for key in ("input_ids", "response_mask", "row_index", "advantages", TOKEN_WEIGHTS):
        if key not in t.keys():
            raise ValueError(f"the DataProto has no {key!r}; was it made by to_dataproto?")
    row_index = t["row_index"]
    keep = (row_index >= 0).nonzero().squeeze(1)
    keep = keep[torch.argsort(row_index[keep])]
    if not torch.equal(row_index[keep], torch.arange(keep.numel())):
        raise ValueError("row_index must hold each row 0..n-1 exactly once")
    ids = keep.tolist()
    rollout_ids = [str(proto.non_tensor_batch["rollout_id"][i]) for i in ids]
    group_ids = [str(proto.non_tensor_batch["uid"][i]) for i in ids]
    states_col = [str(proto.non_tensor_batch["rollout_state"][i]) for i in ids]
    rollouts: list[str] = []
    first_row: list[int] = []
    index = []
    for j, rid in enumerate(rollout_ids):
        if not rollouts or rollouts[-1] != rid:
            if rid in rollouts:
                raise ValueError(f"the rows of rollout {rid!r} are not adjacent")
            rollouts.append(rid)
            first_row.append(j)
        index.append(len(rollouts) - 1)
    rollout_index = torch.tensor(index, dtype=torch.int64)
    first = torch.tensor(first_row, dtype=torch.int64)
    S = t["response_mask"].shape[1]
    sel = t[keep]
    states = [states_col[j] for j in first_row]
    batch = TrainingBatch(
        input_ids=sel["input_ids"],
        attention_mask=sel["attention_mask"],
        position_ids=sel["position_ids"],
        response_mask=sel["response_mask"].bool(),
        rollout_logprobs=sel["rollout_log_probs"] if "rollout_log_probs" in t.keys() else None,
        rollout_ids=rollout_ids,
        group_ids=group_ids,
        turn_index=sel["turn_index"],
        rollout_index=rollout_index,
        rollouts=rollouts,
        rewards=sel["reward"][first],
        rollout_states=states if any(states) else [],
        model_version=sel["model_version"] if "model_version" in t.keys() else None,
    )
    if proto.meta_info.get("token_advantages"):
        advantages = sel["advantages"]
    else:
        advantages = sel["advantages"][first, 0] if S else torch.zeros(len(rollouts))
    return batch, advantages, sel[TOKEN_WEIGHTS]
