"""Data-parallel embedded training: `torchrun --nproc-per-node N -m tracetrain train CONFIG`.

Rank 0 runs what does I/O (gateway, engine, runner, store), builds the step's rows and their
advantages, and hands the same (batch, advantages) to every rank. Every rank then plans the same
mini-batches with the same token weights (`minibatch.plan_step`, weights fixed on the whole
mini-batch before sharding), trains its shard of whole rollouts, and DDP all-reduces the gradient:
with each rank's loss scaled by W (see minibatch.py) the averaged gradient is the single-process
gradient, so every rank takes the same optimizer step as a one-process run would.

Backend: gloo on CPU, NCCL when CUDA is available. Without torchrun's WORLD_SIZE (or with 1) this
is a no-op and the trainer runs as one process.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DataParallel:
    world_size: int = 1
    rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_from_env() -> DataParallel:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DataParallel()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return DataParallel(dist.get_world_size(), dist.get_rank())


def close(dp: DataParallel) -> None:
    """Leave the process group. Drop every DDP wrapper first: DDP's Reducer holds the group, and
    its Python binding frees it with the GIL held; if it held the last reference, the group's
    destructor would join gloo's worker threads while one of them waits for the GIL to free a
    finished collective (a deadlock seen in the 2-rank tests). Freed here, while the group is
    still registered, the wrapper leaves the last reference to destroy_process_group, whose
    binding releases the GIL."""
    if dp.enabled and dist.is_initialized():
        gc.collect()  # wrappers the caller dropped but a reference cycle still holds
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, dp: DataParallel) -> torch.nn.Module:
    """DDP around the policy (its constructor copies rank 0's weights to every rank)."""
    if not dp.enabled:
        return model
    return torch.nn.parallel.DistributedDataParallel(model)


def wrap_policies(model: torch.nn.Module, names: list[str], dp: DataParallel,
                  whole: dict[str, torch.nn.Module] | None = None) -> dict[str, torch.nn.Module]:
    """Several policies (config `policies`): {policy: what its update's forward runs}, for the
    adapters `names` on `model` and the `whole` models. Under torchrun a DDP wrapper each; an
    adapter's is built while it is active: DDP's reducer takes the parameters that require a
    gradient when it is built, adapter p's alone, so p's update all-reduces p's gradient and no
    other (one wrapper over every adapter would wait for the gradients of adapters the forward
    did not use). Without torchrun: the models themselves."""
    whole = whole or {}
    if not dp.enabled:
        return {**dict.fromkeys(names, model), **whole}
    wrappers = {}
    for name in names:
        model.set_adapter(name)
        wrappers[name] = torch.nn.parallel.DistributedDataParallel(model)
    if names:
        model.set_adapter(names[0])
    return {**wrappers, **{name: torch.nn.parallel.DistributedDataParallel(m) for name, m in whole.items()}}


def from_main(obj: Any, dp: DataParallel) -> Any:
    """Rank 0's `obj` on every rank (pickled; the step's rows are small next to the model)."""
    if not dp.enabled:
        return obj
    box = [obj if dp.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sum_over_ranks(values: list[float], dp: DataParallel) -> list[float]:
    """Element-wise sum of every rank's `values` (same length on every rank)."""
    if not dp.enabled or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()
