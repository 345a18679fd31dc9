"""verl's real actor on CPU, in this process: a CPU platform plugin, a gloo process group, and a
`TrainingWorker` (verl 0.9.1's actor: mini-batch loop, FSDP2 engine, micro-batches, optimizer)
built from a tiny model saved to disk. Helpers for test_verl_loss (not fixtures).

verl has no CPU platform; it picks one through its platform registry (`set_platform`) and finds its
engine through `EngineRegistry` by device name, so both are registered here for "cpu". Nothing of
verl's is replaced: the worker, engine, loss plumbing and optimizer are verl's own code.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from gloo_ranks import join_gloo
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_base import PlatformBase


class _CpuDeviceModule:
    """torch.cpu plus the memory statistics verl logs (0 on CPU)."""

    def __getattr__(self, name):
        if name == "mem_get_info":
            return lambda *args, **kwargs: (0, 0)
        if name == "get_device_name":
            return lambda *args, **kwargs: "CPU"
        if name.startswith(("max_memory", "memory_", "reset_peak")):
            return lambda *args, **kwargs: 0
        return getattr(torch.cpu, name)


class CpuPlatform(PlatformBase):
    """verl's platform interface for a machine without accelerators (gloo, torch.cpu)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CpuDeviceModule()

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def use_cpu() -> None:
    """Make verl run on CPU in this process (before verl.workers.engine is imported)."""
    current = platform_manager._current_platform
    if not isinstance(current, CpuPlatform):
        platform_manager.set_platform(CpuPlatform())
    from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead

    registry = EngineRegistry._engines["language_model"]
    for backend in ("fsdp", "fsdp2"):
        if "cpu" not in registry[backend]:
            EngineRegistry.register("language_model", backend, device="cpu")(FSDPEngineWithLMHead)


def init_gloo(rank: int = 0, world_size: int = 1, init_method: str | None = None) -> None:
    """The process group verl's worker expects (Worker reads RANK/WORLD_SIZE/MASTER_* too).
    One process: an in-memory store (no port at all); more: gloo_ranks' rendezvous."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),  # read, never bound: the group exists
        GLOO_SOCKET_IFNAME="lo",
    )
    if dist.is_initialized():
        return
    if world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        join_gloo(init_method, rank, world_size)


def actor_worker(
    model_dir: str,
    actor_config,
    *,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
):
    """verl's TrainingWorker for `actor_config` (an ActorConfig), on the model in `model_dir`:
    the engine settings (strategy, precision, optimizer) are the config's (see CPU_OVERRIDES).

    micro_batch_size: fixed micro-batches of that many rows; else dynamic (max_token_len tokens)."""
    from verl.workers.config import HFModelConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig

    model = HFModelConfig(
        path=model_dir,
        use_remove_padding=False,
        enable_gradient_checkpointing=False,
        override_config={"attn_implementation": "eager"},
    )
    engine = actor_config.engine
    engine.use_dynamic_bsz = micro_batch_size is None
    engine.micro_batch_size_per_gpu = micro_batch_size
    engine.max_token_len_per_gpu = max_token_len
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_type="language_model",
            model_config=model,
            engine_config=engine,
            optimizer_config=actor_config.optim,
            checkpoint_config=actor_config.checkpoint,
        )
    )
    worker.reset()
    return worker


# verl config keys for a CPU run (frozen in verl's dataclasses, so set in the config itself).
CPU_OVERRIDES = {
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision": {
        "param_dtype": "fp32",
        "reduce_dtype": "fp32",
        "buffer_dtype": "fp32",
    },
    "actor_rollout_ref.model.use_remove_padding": False,
    "actor_rollout_ref.model.enable_gradient_checkpointing": False,
}


class LocalActorGroup:
    """The world-size-1 case of verl's worker-group dispatch: `update_actor(td)` runs the actor's
    `train_mini_batch` in this process (what ActorRolloutRefWorker.update_actor does)."""

    def __init__(self, worker):
        self.worker = worker

    def update_actor(self, td):
        return self.worker.train_mini_batch(td)


def capture_gradients(worker) -> list[list[torch.Tensor]]:
    """Record the full gradient of every optimizer step (one list of tensors per step)."""
    engine = worker.engine
    steps: list[list[torch.Tensor]] = []
    params = list(engine.module.parameters())

    def hook(optimizer, args, kwargs):
        grads = []
        for p in params:
            g = p.grad
            if hasattr(g, "full_tensor"):
                g = g.full_tensor()
            grads.append(g.detach().clone())
        steps.append(grads)

    engine.optimizer.register_step_pre_hook(hook)
    return steps


def training_batch(
    rows_per_rollout: list[int],
    *,
    seed: int = 0,
    P: int = 6,
    R: int = 10,
    groups: int = 2,
    model=None,
):
    """(TrainingBatch, rows dict, advantages [n_rollouts], ref logprobs [rows, R]) of random
    rollouts cut into rows (tiny_model.make_rows), with old logprobs near the model's own (so
    some ratios clip) and zero where the mask is False, as the aggregate stage leaves them."""
    from tiny_model import logprobs_and_entropy, make_rows

    from tracetrain.rows.batch import TrainingBatch

    rows = make_rows(rows_per_rollout, P=P, R=R, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = rows["response_mask"]
    if model is None:
        lp = -2.0 + torch.zeros(mask.shape)
    else:
        with torch.no_grad():
            lp, _ = logprobs_and_entropy(model, rows)
    old = (lp + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    ref = lp + 0.3 * torch.randn(mask.shape, generator=g)
    n_rollouts = len(rows_per_rollout)
    ri = rows["rollout_index"]
    names = [f"roll-{k}" for k in range(n_rollouts)]
    batch = TrainingBatch(
        input_ids=rows["input_ids"],
        attention_mask=rows["attention_mask"],
        position_ids=rows["position_ids"],
        response_mask=mask,
        rollout_logprobs=old,
        rollout_ids=[names[k] for k in ri.tolist()],
        group_ids=[f"group-{k % groups}" for k in ri.tolist()],
        turn_index=torch.cat([torch.arange(c) for c in rows_per_rollout]),
        rollout_index=ri,
        rollouts=names,
        rewards=torch.rand(n_rollouts, generator=g),
        rollout_states=["succeeded"] * n_rollouts,
        model_version=torch.randint(0, 3, (mask.shape[0],), generator=g),
    )
    advantages = torch.randn(n_rollouts, generator=g)
    return batch, rows, advantages, ref
