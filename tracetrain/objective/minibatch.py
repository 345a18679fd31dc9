"""Optimizer-step partitioning: a step's rows -> mini-batches -> (ranks) -> micro-batches.

1. Mini-batches are made of whole rollouts (or whole groups), balanced by token count: a rollout
   never spans two optimizer updates (docs/invariants.md invariant 4).
2. The token weights of a mini-batch are computed once, on the whole mini-batch (invariant 3):
   w[i,t] = m[i,t] * s_i with s from `weights.row_scales`. Its loss is L = sum_{i,t} w[i,t] l[i,t].
3. Data parallelism: the mini-batch's rows are sharded over the ranks after the scales are fixed.
4. Each rank cuts its shard into micro-batches under a token budget. A micro-batch's loss is the
   same sum restricted to its rows, with the mini-batch's scales, so the micro-batch losses add up
   to L exactly: gradient accumulation is a plain sum, with no 1/num_micro_batches factor.

Scaling for DDP / FSDP: they all-reduce the gradient as an average, (1/W) sum_k g_k over W ranks,
while the gradient we want is the sum, grad L = sum_k g_k (each rank holds a disjoint part of the
sum). So every rank multiplies its micro-batch losses by W (`loss_scale`, folded into the micro-
batch's row scales here): (1/W) sum_k W g_k = sum_k g_k = the single-process gradient. Use
`model.no_sync()` for all but a rank's last micro-batch, so each rank all-reduces once per
mini-batch (ranks may have different numbers of micro-batches).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tracetrain.objective.weights import (
    as_mask,
    rollout_inverse,
    row_token_counts,
    scales_from_counts,
)


@dataclass
class MicroBatch:
    rows: torch.Tensor  # [n] int64: row indices into the step's batch, ascending
    row_scales: (
        torch.Tensor
    )  # [n] float32: the mini-batch's scales for these rows, times loss_scale
    n_tokens: int  # cost of these rows (see plan_step's row_tokens)


@dataclass
class MiniBatch:
    rows: torch.Tensor  # [n] int64: all rows of this optimizer update (every rank), ascending
    row_scales: torch.Tensor  # [n] float32: scales of `rows`, computed on the whole mini-batch
    n_rollouts: int
    n_tokens: int
    micro_batches: list[MicroBatch]  # this rank's share of the rows
    loss_scale: float  # = world_size, already folded into the micro-batches' row_scales


def balanced_bins(costs: Sequence[int], n_bins: int) -> list[list[int]]:
    """Assign items to n_bins with near-equal total cost (LPT: largest item to the lightest bin).

    The heaviest bin exceeds the lightest by at most the largest item; with at least n_bins items
    no bin is empty (zero-cost items included). Items in a bin ascend.
    """
    order = sorted(range(len(costs)), key=lambda k: (-costs[k], k))
    heap = [(0, 0, b) for b in range(n_bins)]  # (load, items, bin): ties go to the emptier bin
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for k in order:
        load, items, b = heapq.heappop(heap)
        bins[b].append(k)
        heapq.heappush(heap, (load + costs[k], items + 1, b))
    return [sorted(b) for b in bins]


def micro_batches(costs: Sequence[int], budget: int | None) -> list[list[int]]:
    """Cut items, in order, into runs whose total cost is <= budget (an item over it runs alone)."""
    if budget is None:
        return [list(range(len(costs)))] if len(costs) else []
    runs: list[list[int]] = []
    run: list[int] = []
    total = 0
    for k, c in enumerate(costs):
        if run and total + c > budget:
            runs.append(run)
            run, total = [], 0
        run.append(k)
        total += c
    if run:
        runs.append(run)
    return runs


def plan_step(
    response_mask: torch.Tensor,
    rollout_index: torch.Tensor,
    *,
    n_mini_batches: int = 1,
    micro_batch_tokens: int | None = None,
    mode: str = "rollout-mean",
    norm_length: float | None = None,
    groups: Sequence[str] | torch.Tensor | None = None,
    row_tokens: torch.Tensor | None = None,
    micro_costs: Callable[[torch.Tensor], Sequence[int]] | None = None,
    world_size: int = 1,
    rank: int = 0,
) -> list[MiniBatch]:
    """Plan one step's optimizer updates (see the module docstring).

    - rollout_index [rows]: the rollout of each row (`TrainingBatch.rollout_index`).
    - groups [rows] (optional): keep whole groups in one mini-batch (the group of each row).
    - row_tokens [rows] (optional): the cost of a row for balancing and for the micro-batch
      budget, e.g. `attention_mask.sum(1)` (what the forward pass costs). Default: trained tokens.
    - micro_costs (optional): rows (a shard's, in order) -> what each costs in a micro-batch
      after the row before it (e.g. packing.row_costs: a shared start is computed once); the
      micro-batch budget counts these. Default: row_tokens. Mini-batches and shards are
      balanced by row_tokens either way, so they do not depend on it.
    - world_size, rank: this rank's micro-batches; the scales are the same on every rank.
    """
    if not isinstance(n_mini_batches, int) or n_mini_batches < 1:
        raise ValueError(f"n_mini_batches must be an int >= 1, got {n_mini_batches!r}")
    if micro_batch_tokens is not None and (
        not isinstance(micro_batch_tokens, int) or micro_batch_tokens < 1
    ):
        raise ValueError(
            f"micro_batch_tokens must be an int >= 1 or None, got {micro_batch_tokens!r}"
        )
    if (
        not isinstance(world_size, int)
        or world_size < 1
        or not isinstance(rank, int)
        or not 0 <= rank < world_size
    ):
        raise ValueError(
            f"need 0 <= rank < world_size, got rank={rank!r} world_size={world_size!r}"
        )
    response_mask = as_mask(response_mask)
    rows = response_mask.shape[0]
    trained = row_token_counts(response_mask)
    if row_tokens is None:
        cost = trained
    elif not isinstance(row_tokens, torch.Tensor) or row_tokens.shape != (rows,):
        raise ValueError(f"row_tokens must be a tensor of shape ({rows},)")
    else:
        cost = row_tokens.to(torch.int64)
    rollout, n_rollouts = rollout_inverse(rollout_index, rows)

    # Units that must stay whole: rollouts, or groups (a rollout must then lie in one group).
    if groups is None:
        unit, n_units = rollout, n_rollouts
    else:
        unit, n_units = rollout_inverse(groups, rows)
        hi = torch.full((n_rollouts,), -1, dtype=torch.int64).scatter_reduce_(
            0, rollout, unit, "amax"
        )
        lo = torch.full((n_rollouts,), n_units, dtype=torch.int64).scatter_reduce_(
            0, rollout, unit, "amin"
        )
        if (hi != lo).any():
            k = int((hi != lo).nonzero()[0])
            first = int((rollout == k).nonzero()[0])
            raise ValueError(f"the rows of one rollout (row {first}'s) lie in two groups")
    if n_mini_batches > n_units:
        what = "groups" if groups is not None else "rollouts"
        raise ValueError(
            f"cannot make {n_mini_batches} mini-batches of whole {what} from {n_units} {what}"
        )

    unit_cost = torch.zeros(n_units, dtype=torch.int64).index_add_(0, unit, cost)
    unit_bin = torch.empty(n_units, dtype=torch.int64)
    for b, members in enumerate(balanced_bins(unit_cost.tolist(), n_mini_batches)):
        unit_bin[members] = b
    row_bin = unit_bin[unit]

    plan = []
    for b in range(n_mini_batches):
        mb_rows = (row_bin == b).nonzero().squeeze(1)
        # Scales once for the whole mini-batch: every rank and micro-batch uses these.
        scales = scales_from_counts(
            trained[mb_rows], rollout[mb_rows], mode=mode, norm_length=norm_length
        )
        if mb_rows.numel() < world_size:
            raise ValueError(
                f"mini-batch {b} has {mb_rows.numel()} rows, fewer than world_size={world_size}; "
                "use fewer mini-batches"
            )
        mb_cost = cost[mb_rows].tolist()
        shard = balanced_bins(mb_cost, world_size)[rank]  # positions within the mini-batch
        shard_cost = ([int(c) for c in micro_costs(mb_rows[torch.tensor(shard, dtype=torch.int64)])]
                      if micro_costs is not None and shard else [mb_cost[p] for p in shard])
        micro = []
        for run in micro_batches(shard_cost, micro_batch_tokens):
            pos = torch.tensor([shard[k] for k in run], dtype=torch.int64)
            micro.append(
                MicroBatch(
                    rows=mb_rows[pos],
                    row_scales=scales[pos] * world_size,  # DDP averages over ranks: see top
                    n_tokens=sum(shard_cost[k] for k in run),
                )
            )
        plan.append(
            MiniBatch(
                rows=mb_rows,
                row_scales=scales,
                n_rollouts=int(torch.unique(rollout[mb_rows]).numel()),
                n_tokens=int(sum(mb_cost)),
                micro_batches=micro,
                loss_scale=float(world_size),
            )
        )
    return plan
