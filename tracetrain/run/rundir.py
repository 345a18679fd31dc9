"""What a run leaves beside its rows: its directory's files and the step line (the trackers:
run/trackers.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tracetrain.config import ConfigError, TrainConfig

RUN_FILES = ("metrics.jsonl", "checkpoint.pt", "checkpoints", "traces.db")  # what a run leaves in its run_dir


def refuse_earlier_run(run_dir: Path, *, resumable: bool) -> None:
    """A new run never writes into an earlier one's files (its metrics would be mixed in)."""
    earlier = [n for n in RUN_FILES if (run_dir / n).exists()]
    if not earlier:
        return
    how = "give a new or empty directory"
    if resumable:
        how = ("trainer.resume=true continues it" if {"checkpoint.pt", "checkpoints"} & set(earlier) else
               "trainer.resume=true starts it over (it has no checkpoint)") + "; or " + how
    raise ConfigError(f"config key 'trainer.run_dir': {run_dir} already holds a run "
                      f"({', '.join(earlier)}); {how}")


def rewrite_metrics(run_dir: Path, history: list[dict]) -> None:
    """metrics.jsonl := one line per step of `history`, through a rename (a kill mid-write leaves
    the earlier file)."""
    tmp = run_dir / "metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(m) + "\n" for m in history))
    tmp.replace(run_dir / "metrics.jsonl")


def claim_run_dir(run_dir: Path, cfg: TrainConfig, resumed: list[dict] | None) -> None:
    """Rank 0, before the first step: metrics.jsonl holds this run's steps only (`resumed`, the
    checkpoint's history: those logged after it are run again), then config.json."""
    metrics = run_dir / "metrics.jsonl"
    if resumed is not None:
        rewrite_metrics(run_dir, resumed)
    elif cfg.trainer.resume:  # nothing to resume from: start over
        metrics.unlink(missing_ok=True)
    else:
        refuse_earlier_run(run_dir, resumable=True)
    tmp = run_dir / "config.json.tmp"
    tmp.write_text(cfg.model_dump_json(indent=2))
    tmp.replace(run_dir / "config.json")  # whole or absent to a reader (tracetrain view)


def format_step(m: dict) -> str:
    """One line per step: what a person watching a run wants to see."""
    drift = "/".join(str(int(m.get(f"aggregate/breaks/{k}", 0)))
                     for k in ("retokenization", "assistant_rewrite", "context_rewrite"))
    parts = [
        f"step {m['step']:4d}",
        f"reward {m['reward_mean']:.3f}",
        f"rollouts/s {m['rollouts_per_s']:.1f}",
        f"tok/s {m['trained_tokens_per_s']:.0f}",
        f"rows/rollout {m['rows_per_rollout']:.2f}",
        f"drift r/a/c {drift}",
        f"fail {m['n_failed']}+{m['n_timed_out']}",
    ]
    if "loss" in m:
        parts.append(f"loss {m['loss']:+.4f}")
    if "loss/rollout_mass_x_R_min" in m:
        parts.append(f"mass/rollout x R {m['loss/rollout_mass_x_R_min']:.3f}"
                     f"..{m['loss/rollout_mass_x_R_max']:.3f}")
    if m.get("loss/tokens_padded"):  # the forward's tokens against a padded batch's
        parts.append(f"computed {m['loss/tokens_computed'] / m['loss/tokens_padded']:.2f} of padded")
    if "memory/peak_rss_gb" in m:
        parts.append(f"peak {m['memory/peak_rss_gb']:.1f} GB")
    if "engine/logprob_gap_max" in m:  # engine vs trainer logprobs, same weights
        parts.append(f"gap {m['engine/logprob_gap_max']:.0e}")
    if "correction/weight_mean" in m:  # importance corrections (correction.py)
        parts.append(f"IS {m['correction/weight_mean']:.2f} max {m['correction/weight_max']:.2f}"
                     f" rejected {m['correction/rejected_rollouts']}")
    if "collect/groups_taken" in m:  # continuous collection: how old, how busy
        ages = [int(k.rsplit("_", 1)[1]) for k in m if k.startswith("staleness/rollouts_")]
        parts.append(f"stale <= {max(ages, default=0)} | engine idle {m.get('engine/idle_frac', 0):.2f}")
    if "time/update_idle_frac" in m and "collect/groups_taken" not in m:  # who waited for whom
        parts.append(f"idle: engine {m.get('engine/idle_frac', 0):.2f} "
                     f"update {m['time/update_idle_frac']:.2f}")
    if "eval/reward_mean" in m:
        parts.append(f"eval {m['eval/reward_mean']:.3f}")
    return " | ".join(parts)
