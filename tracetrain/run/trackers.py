"""Trackers: where a run's step metrics go besides metrics.jsonl (`trainer.report_to`).

    with open_trackers(cfg, run_dir, log) as trackers:   each named tracker started with the
                                                          run's config (start_trackers: unclosed)
        trackers.log(m)                  a step's numeric metrics, at step m["step"]
        trackers.samples(after, rows)    an eval pass's sample rollouts {task, reply, reward} (the
                                         pass after step `after`), a table where the tracker has them
    (closed at the end of the block)

Each tracker is named as its package names itself: `tensorboard` (event files in
run_dir/tensorboard), `wandb` (project `tracetrain`; WANDB_MODE=offline keeps it on disk),
`trackio` (project `tracetrain`, its local store: TRACKIO_DIR), `mlflow` (experiment
`tracetrain`; MLFLOW_TRACKING_URI, else MLflow's own default, ./mlflow.db). Every run is named
after its run_dir. A tracker never stops training: one that cannot start (its package missing, its
server down) is named once and left out; one that raises later is warned about once and left out.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tracetrain.config import TrainConfig

INSTALL = "pip install 'tracetrain[trackers]'"


def numeric(m: dict) -> dict[str, float]:
    """The metrics a tracker plots: every int or float of `m` but `step`."""
    return {k: v for k, v in m.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


def markdown_table(rows: list[dict]) -> str:
    """rows (same keys) as a Markdown table, `|` and newlines in cells escaped."""
    cols = list(rows[0]) if rows else []
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
                      *("| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows)])


class TensorBoard:
    def __init__(self, cfg: TrainConfig, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def samples(self, key: str, rows: list[dict], step: int) -> None:
        self.writer.add_text(key, markdown_table(rows), step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """wandb's run API (trackio's is the same: `Trackio`): log(dict, step), Table(columns, data)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, config: dict):
        import wandb

        self.module = wandb
        self.run = wandb.init(project="tracetrain", name=run_dir.name, dir=str(run_dir),
                              config=config, reinit="create_new")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def samples(self, key: str, rows: list[dict], step: int) -> None:
        cols = list(rows[0]) if rows else []
        self.run.log({key: self.module.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])},
                     step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio(WandB):
    def __init__(self, cfg: TrainConfig, run_dir: Path, config: dict):
        import trackio

        self.module = trackio
        self.run = trackio.init(project="tracetrain", name=run_dir.name, config=config,
                                resume="allow", embed=False, auto_log_cpu=False, auto_log_gpu=False)


class MLflow:
    KEY = re.compile(r"[^/\w.\- :]")  # what MLflow refuses in a metric or param name

    def __init__(self, cfg: TrainConfig, run_dir: Path, config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        exp = self.client.get_experiment_by_name("tracetrain")
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment("tracetrain")
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [Param(self.KEY.sub("_", k), json.dumps(v)[:6000]) for k, v in flat(config).items()]
        for i in range(0, len(params), 100):  # (MLflow takes 100 params a batch)
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(self.KEY.sub("_", k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # (and 1000 metrics)
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def samples(self, key: str, rows: list[dict], step: int) -> None:
        cols = list(rows[0]) if rows else []
        self.client.log_table(self.run_id, {c: [r[c] for r in rows] for c in cols},
                              f"{key}_step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS: dict[str, Callable[[TrainConfig, Path, dict], Any]] = {
    "tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio, "mlflow": MLflow}
"""trainer.report_to's names -> the tracker's class: (cfg, run_dir, config dict) -> an object
with log(metrics, step), samples(key, rows, step), close()."""


def flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Trackers:
    """The started trackers of a run; each call goes to every one still in (module docstring)."""

    def __init__(self, started: dict[str, Any] | None = None, log=print):
        self.started, self.say = dict(started or {}), log

    def _each(self, what: str, call: Callable[[Any], None]) -> None:
        for name, tracker in list(self.started.items()):
            try:
                call(tracker)
            except Exception as e:  # a tracker never stops the run
                del self.started[name]
                self.say(f"tracker {name!r} left out from here on: {what} failed "
                         f"({type(e).__name__}: {e})")

    def log(self, m: dict) -> None:
        metrics = numeric(m)
        self._each(f"logging step {m['step']}", lambda t: t.log(metrics, m["step"]))

    def samples(self, after: int, rows: list[dict]) -> None:
        """An eval pass's rows, after step `after`'s update: as eval/samples at that step; -1
        (before the first step): as eval/initial_samples at step 0."""
        key, step = ("eval/samples", after) if after >= 0 else ("eval/initial_samples", 0)
        if rows:
            self._each(f"the eval samples of step {step}", lambda t: t.samples(key, rows, step))

    def close(self) -> None:
        self._each("closing", lambda t: t.close())


NO_TRACKERS = Trackers()  # outside a run: nothing is started


def start_trackers(cfg: TrainConfig, run_dir: Path, log=print) -> Trackers:
    """The trackers of trainer.report_to, started (the caller closes them)."""
    started, config = {}, cfg.model_dump(mode="json")
    for name in cfg.trainer.report_to:
        try:
            started[name] = TRACKERS[name](cfg, run_dir, config)
        except ImportError as e:
            log(f"tracker {name!r} left out: its package is not installed ({e}; {INSTALL})")
        except Exception as e:
            log(f"tracker {name!r} left out: it did not start ({type(e).__name__}: {e})")
    return Trackers(started, log)


@contextlib.contextmanager
def open_trackers(cfg: TrainConfig, run_dir: Path, log=print) -> Iterator[Trackers]:
    """start_trackers, closed when the block ends."""
    trackers = start_trackers(cfg, run_dir, log)
    try:
        yield trackers
    finally:
        trackers.close()

