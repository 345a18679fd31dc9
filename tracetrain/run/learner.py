"""The learner: the policy's weights and how they learn from one step's rollouts.

    rows      the step's rollouts -> rows and advantages (run/step.build_rows); several
              policies: each policy's own rows too (run/policies.py)
    update    PPO on those rows (learn/update.ppo_update), on the update thread; several
              policies: each policy with rows in turn, its adapter active (or its own model)
    metrics   loss, grad_norm, loss/*, engine/logprob_gap_* (several: policy/<p>/..., and the
              step's over them)

`Learner` learns one policy, `Policies` several (config `policies`); the loop (run/trainer.py)
calls the same methods on either, and a DDP rank other than 0 calls `update` on rank 0's work.
`checkpoint` is the learner's share of a run's checkpoint, `restore` puts it back.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from tracetrain.config import ConfigError, TrainConfig
from tracetrain.learn.distributed import DataParallel, wrap, wrap_policies
from tracetrain.learn.optim import optimizer_and_schedule
from tracetrain.learn.update import ppo_update
from tracetrain.models import lora
from tracetrain.models.compute import on_compute
from tracetrain.run import checkpoint, policies
from tracetrain.run.step import Rows, build_rows, update_metrics


def load_learner(cfg: TrainConfig, threads: int, dp: DataParallel) -> Learner:
    """The run's learner: the model loaded on the compute thread with `threads` torch threads
    (models/compute.py), a fresh adapter under LoRA, several policies' adapters or models, on
    trainer.device."""
    from tracetrain.models.load import load_policy

    model, tokenizer = on_compute(threads, load_policy, cfg.model, seed=cfg.trainer.seed)
    if cfg.model.lora is not None:  # the base frozen, a fresh adapter (lora.py)
        model = lora.wrap(model, cfg.model.lora)
    # several policies (run/policies.py): whole-model ones' models; the others' adapters
    whole = policies.whole_models(cfg, model, tokenizer) if cfg.policies else {}
    if cfg.adapter_policies:
        model = lora.wrap_policies(model, cfg.adapter_policies)
    if cfg.trainer.device != "cpu":
        if not torch.cuda.is_available():
            raise ConfigError(f"config key 'trainer.device': {cfg.trainer.device!r}, and this "
                              "machine has no CUDA device")
        for m in (model, *whole.values()):
            m.to(cfg.trainer.device)
    return (Policies if cfg.policies is not None else Learner)(cfg, model, tokenizer, whole, dp)


class Learner:
    """One policy: `model` (under LoRA the adapter trains), its AdamW and schedule, its KL
    reference (loss.kl_coef > 0), and the frozen copy roles.serve "frozen" roles are served by."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, tokenizer,
                 whole: dict[str, torch.nn.Module], dp: DataParallel):
        self.cfg, self.model, self.tokenizer, self.whole, self.dp = cfg, model, tokenizer, whole, dp
        self.forward: Any = model  # what the update's forward runs (DDP around it: `wrap`)
        self.optimizer, self.scheduler = self.optimizers()
        self.ref_model: torch.nn.Module | None = None  # the KL reference
        self.whole_refs: dict[str, torch.nn.Module] = {}  # whole-model policies': theirs
        self.frozen: torch.nn.Module | None = None  # roles.serve "frozen": never updated

    def optimizers(self) -> tuple[Any, Any]:
        return optimizer_and_schedule(lora.trainable(self.model), self.cfg.optim,
                                      self.cfg.trainer.steps)

    def reconfigure(self, cfg: TrainConfig) -> None:
        """The run's config once trainer.precision "auto" is resolved (run/precision.py)."""
        self.cfg = cfg

    def wrap(self) -> None:
        """DDP around what the update runs (under torchrun: rank 0's weights copied to all)."""
        self.forward = wrap(self.model, self.dp)

    def unwrap(self) -> None:
        """The DDP wrapper gone (before the process group closes)."""
        self.forward = self.model

    def start_reference(self) -> None:
        """The KL reference: a frozen copy of the policy as RL starts (or the restored one)."""
        if policies.needs_reference(self.cfg) and self.ref_model is None:
            self.ref_model = checkpoint.frozen_copy(self.model)
        if not self.whole_refs:
            self.whole_refs = policies.references(self.cfg, self.whole)

    def frozen_policy(self) -> torch.nn.Module:
        """The copy of the policy that serves roles.serve "frozen" roles: made as training starts
        (after the warm start), or the checkpoint's."""
        if self.frozen is None:
            self.frozen = checkpoint.frozen_copy(self.model)
        return self.frozen

    def rows(self, store, results: list, version: int) -> tuple[Rows, Any]:
        """(the step's rows, advantages and row metrics; what `update` takes) of `results` at
        policy version `version`."""
        rows = build_rows(store, results, self.cfg, self.tokenizer, version)
        return rows, rows

    def update(self, work: Any, *, measure_gap: bool = False, stop=None) -> Any:
        """The optimizer updates of one step on `work` (`rows`'s second); their results."""
        return ppo_update(self.forward, self.optimizer, work.batch, work.advantages, self.cfg,
                          ref_model=self.ref_model, scheduler=self.scheduler, dp=self.dp,
                          measure_gap=measure_gap, stop=stop)

    def update_metrics(self, updates: Any) -> dict[str, float]:
        return update_metrics(updates)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def checkpoint(self) -> dict:
        """The learner's share of a checkpoint (run/checkpoint.py): model, optimizer, scheduler,
        ref_model, whole, whole_refs, frozen."""
        return {
            "model": lora.weights(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "ref_model": None if self.ref_model is None else self.ref_model.state_dict(),
            "whole": {name: m.state_dict() for name, m in self.whole.items()},
            "whole_refs": {name: m.state_dict() for name, m in self.whole_refs.items()},
            "frozen": None if self.frozen is None else lora.weights(self.frozen),
        }

    def restore(self, ck: dict, path: Path) -> None:
        """`checkpoint`'s keys of the checkpoint `ck` (read from `path`) put back."""
        lora.load_weights(self.model, ck["model"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.scheduler.load_state_dict(ck["scheduler"])
        if ck["ref_model"] is not None:
            self.ref_model = checkpoint.frozen_copy(self.model)
            self.ref_model.load_state_dict(ck["ref_model"])
        if sorted(ck.get("whole", {})) != sorted(self.whole):
            raise checkpoint.CheckpointError(
                f"{path}: whole-model policies {sorted(ck.get('whole', {}))}; this run's are "
                f"{sorted(self.whole)} (policies.*.lora, policies.*.model)")
        for name, m in self.whole.items():  # in place: the optimizers hold their parameters
            m.load_state_dict(ck["whole"][name])
        self.whole_refs = {name: checkpoint.frozen_copy(self.whole[name])
                           for name in ck.get("whole_refs", {})}
        for name, ref in self.whole_refs.items():
            ref.load_state_dict(ck["whole_refs"][name])
        if ck.get("frozen") is not None:
            self.frozen = checkpoint.frozen_copy(self.model)
            lora.load_weights(self.frozen, ck["frozen"])

    async def warm_start(self, task: Any, update_thread, log=print) -> None:
        """warm_start.steps supervised steps on the task module's transcripts (learn/warmstart.py);
        several policies: the base they share, then the whole-model copies take it."""
        from tracetrain.learn.warmstart import warm_start

        cfg, ws, t = self.cfg, self.cfg.warm_start, time.perf_counter()
        make = getattr(task, ws.transcripts, None)
        if not callable(make):
            raise ConfigError("config key 'warm_start.transcripts': the task module has no "
                              f"function {ws.transcripts!r}")
        transcripts = make(ws.steps * ws.batch_size, seed=cfg.trainer.seed, **cfg.task_args)
        with lora.base_trainable(self.model) if cfg.adapter_policies else contextlib.nullcontext():
            losses = await update_thread.run(  # nothing else runs yet: the larger thread count
                max(update_thread.threads, update_thread.update_threads), warm_start, self.model,
                self.tokenizer, transcripts, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr,
                seed=cfg.trainer.seed, precision=cfg.trainer.precision)
        log(f"warm start: {ws.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"in {time.perf_counter() - t:.1f} s")
        policies.copy_base(cfg, self.model, self.whole)  # the warm-started backbone

    def write_policy(self, path: Path) -> Path:
        """The run's policy/ folder (checkpoint.write_policy)."""
        return checkpoint.write_policy(self.model, self.tokenizer, path, self.whole)


class Policies(Learner):
    """Several policies (run/policies.py): `optimizer` and `scheduler` by policy, each policy's
    rows and update its own, one model version for all."""

    def optimizers(self) -> tuple[Any, Any]:
        return policies.optimizers(self.cfg, self.model, self.whole)

    def wrap(self) -> None:
        self.forward = wrap_policies(self.model, list(self.cfg.adapter_policies), self.dp,
                                     self.whole)

    def rows(self, store, results: list, version: int) -> tuple[Rows, Any]:
        """The step's rows (every trained role's: the step's metrics), and {policy: its rows}
        (what `update` takes), whose aggregate/, advantage/ and entropy/ metrics join the step's
        as policy/<p>/..."""
        rows = build_rows(store, results, self.cfg, self.tokenizer, version)
        parts = policies.build_policy_rows(store, results, self.cfg, self.tokenizer, version)
        metrics = {**rows.metrics, **policies.row_metrics(parts)}
        return Rows(rows.batch, rows.advantages, metrics), parts

    def update(self, work: Any, *, measure_gap: bool = False, stop=None) -> Any:
        refs = {**dict.fromkeys(self.cfg.adapter_policies, self.ref_model), **self.whole_refs}
        return policies.update(self.forward, work, self.optimizer, self.scheduler, self.cfg,
                               refs=refs, measure_gap=measure_gap, stop=stop, dp=self.dp)

    def update_metrics(self, updates: Any) -> dict[str, float]:
        return policies.policy_update_metrics(updates, self.scheduler)
