"""Two real processes, torch.distributed on gloo over loopback, DDP: the gradient of a mini-batch
sharded over 2 ranks (weights computed before sharding, per-rank loss times world_size, DDP's
gradient average) equals the single-process gradient of the same mini-batch."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from gloo_ranks import join_gloo, leave_gloo, run_ranks
from tiny_model import (
    logprobs_and_entropy,
    make_rows,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    tiny_causal_lm,
)

from tracetrain.objective.loss import policy_loss
from tracetrain.objective.minibatch import plan_step
from tracetrain.objective.weights import RowWeights

MODES = ["rollout-mean", "seq-mean-token-mean"]
WORLD = 2
DEADLINE_S = 180


def step_data():
    """The same step on every process: rows, old / reference logprobs, per-row advantages."""
    rows = make_rows([1, 3, 2, 1, 2, 3, 1, 2], seed=11)
    model = tiny_causal_lm(seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        lp0, _ = logprobs_and_entropy(model, rows)
    old = lp0 + 0.2 * torch.randn(lp0.shape, generator=g)
    ref = lp0 + 0.2 * torch.randn(lp0.shape, generator=g)
    ri = rows["rollout_index"]
    adv = torch.randn(int(ri.max()) + 1, generator=g)[ri]
    return rows, old, ref, adv


def gradient(model, rows, old, ref, adv, mode, *, world_size=1, rank=0, budget=None):
    """One mini-batch: this rank's micro-batches, accumulated; DDP syncs on the last backward."""
    model.zero_grad()
    (mb,) = plan_step(
        rows["response_mask"],
        rows["rollout_index"],
        mode=mode,
        micro_batch_tokens=budget,
        world_size=world_size,
        rank=rank,
    )
    micro = mb.micro_batches
    for j, m in enumerate(micro):
        sync = nullcontext() if j == len(micro) - 1 or world_size == 1 else model.no_sync()
        with sync:
            lp, ent = logprobs_and_entropy(model, rows, m.rows)
            loss, _ = policy_loss(
                lp,
                old[m.rows],
                adv[m.rows],
                RowWeights(rows["response_mask"][m.rows], m.row_scales),
                ref_logprobs=ref[m.rows],
                kl_coef=0.05,
                entropy=ent,
                entropy_coef=0.01,
            )
            loss.backward()
    params = model.module.parameters() if world_size > 1 else model.parameters()
    return [p.grad.detach().clone() for p in params], len(micro)


def ddp_gradients(rank: int) -> dict:
    rows, old, ref, adv = step_data()
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_causal_lm(seed=0))
    return {
        mode: gradient(ddp, rows, old, ref, adv, mode, world_size=WORLD, rank=rank, budget=6)
        for mode in MODES
    }


def _worker(rank: int, init_method: str, out: str) -> None:
    torch.set_num_threads(1)
    join_gloo(init_method, rank, WORLD)
    try:
        torch.save(ddp_gradients(rank), Path(out) / f"rank{rank}.pt")  # DDP freed on return
    finally:
        leave_gloo()


@pytest.mark.slow
def test_two_gloo_ranks_give_the_single_process_gradient(tmp_path):
    run_ranks(_worker, (str(tmp_path),), WORLD, DEADLINE_S, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{k}.pt") for k in range(WORLD)]
    rows, old, ref, adv = step_data()
    model = tiny_causal_lm(seed=0)
    for mode in MODES:
        expected, n_micro = gradient(model, rows, old, ref, adv, mode)
        assert n_micro == 1
        assert any(e.abs().sum() > 0 for e in expected)
        for rank in ranks:
            got, n = rank[mode]
            assert n > 1  # each rank accumulated several micro-batches
            # as test_minibatch's partition test: other matmul shapes and accumulation order over
            # micro-batches and the all-reduce (<~ 100 u relative); rtol 1e-4 has ~20x room
            for e, a in zip(expected, got, strict=True):
                assert torch.allclose(a, e, rtol=1e-4, atol=1e-6), mode
