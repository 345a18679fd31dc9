"""What a person looks at after a run: the reward/eval curve PNG and a short summary."""

from __future__ import annotations

import math
from pathlib import Path


def moving_average(xs: list[float], k: int) -> list[float]:
    out, window = [], []
    for x in xs:
        window.append(x)
        if len(window) > k:
            window.pop(0)
        finite = [v for v in window if not math.isnan(v)]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


def plot_curves(history: list[dict], path: str | Path, *, window: int = 10, title: str = "") -> Path:
    """Training reward per step, its moving average, and eval reward where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    reward = [m["reward_mean"] for m in history]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, reward, color="tab:blue", alpha=0.3, lw=1, label="train reward (step mean)")
    ax.plot(steps, moving_average(reward, window), color="tab:blue", lw=2,
            label=f"train reward ({window}-step mean)")
    ev = [(m["step"] - 1, m["eval/initial_reward_mean"]) for m in history[:1]
          if "eval/initial_reward_mean" in m]  # before the first step
    ev += [(m["step"], m["eval/reward_mean"]) for m in history if "eval/reward_mean" in m]
    if ev:
        ax.plot(*zip(*ev, strict=True), "o-", color="tab:orange", lw=1.5, label="eval reward (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title or "tracetrain")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def summary(history: list[dict], *, window: int = 10, target_gain: float = 0.3,
            cancelled_at_end: int = 0) -> dict:
    """First and last `window`-step mean reward, the gain, the best moving average, totals (with
    `cancelled_at_end`: the rollouts still running when the run ended, failed and never trained), and
    the first step whose `window`-step mean is >= the first window's mean + `target_gain`
    (with its `time/elapsed_s`: seconds since the run started, warm start included), or None;
    likewise over `reward_untrained`, the mean reward of the steps whose rollouts the untrained
    policy generated (`rollout_model_version` 0), when the history says."""
    reward = [m["reward_mean"] for m in history]
    ma = moving_average(reward, window)
    first = ma[min(window, len(ma)) - 1] if ma else float("nan")
    head = [r for r in reward[:window] if not math.isnan(r)]
    start = sum(head) / len(head) if head else float("nan")
    out = {
        "steps": len(history),
        "reward_first_window": start,
        "reward_last_window": ma[-1] if ma else float("nan"),
        "reward_gain": (ma[-1] - start) if ma else float("nan"),
        "best_moving_average": max((v for v in ma if not math.isnan(v)), default=float("nan")),
        "first_full_window": first,
        "failed_rollouts": sum(m.get("n_failed", 0) for m in history),
        "timed_out_rollouts": sum(m.get("n_timed_out", 0) for m in history),
        "cancelled_at_end_rollouts": cancelled_at_end,
    }
    def reached(base: float) -> int | None:  # the first full window at base + target_gain
        return next((k for k, v in enumerate(ma) if k >= window - 1 and v >= base + target_gain - 1e-9), None)

    out["target_gain"] = target_gain
    hit = reached(start)
    out["target_gain_step"] = None if hit is None else history[hit]["step"]
    out["target_gain_elapsed_s"] = None if hit is None else history[hit].get("time/elapsed_s")
    # The untrained policy's own reward: the rollouts its weights (model version 0) generated. The
    # first window mixes in steps already trained, a baseline too high when learning is fast.
    untrained = [m["reward_mean"] for m in history
                 if m.get("rollout_model_version") == 0 and not math.isnan(m["reward_mean"])]
    if untrained:
        out["reward_untrained"] = sum(untrained) / len(untrained)
        hit = reached(out["reward_untrained"])
        out["untrained_gain_step"] = None if hit is None else history[hit]["step"]
        out["untrained_gain_elapsed_s"] = None if hit is None else history[hit].get("time/elapsed_s")
    evals = [m["eval/reward_mean"] for m in history if "eval/reward_mean" in m]
    if history and "eval/initial_reward_mean" in history[0]:
        out["eval_initial"] = history[0]["eval/initial_reward_mean"]
    if evals:
        out["eval_first"], out["eval_last"], out["eval_best"] = evals[0], evals[-1], max(evals)
    return out
