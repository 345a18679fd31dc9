"""The run around the step: its length, seed, directory, checkpoints, eval passes, devices and
metric sinks (`trainer`), and the supervised warm start before it (`warm_start`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tracetrain.config.base import ObjectSpec, _Section, named_once, union_sections
from tracetrain.config.model import RemoteModelConfig
from tracetrain.paths import near_config, not_found


class ScriptedExpertConfig(_Section):
    """An expert written in Python: `fn(messages, tools) -> reply` (sync or async), the reply a chat
    assistant message {"content", "tool_calls"} or a str."""

    kind: Literal["scripted"]
    """`scripted`: a Python function plays the environment."""
    path: ObjectSpec
    """The function, `module:name` or `file.py:name` (relative to the config file)."""
    rollouts: int = Field(64, gt=0)
    """Rollouts the expert plays (one per training task, in the run's task order)."""
    min_reward: float | None = None
    """Only the expert's rollouts with a reward at least this are trained on (null: every one
    that succeeded)."""


class ModelExpertConfig(_Section):
    """An expert that is a model behind an OpenAI-compatible URL (a bigger model, a teacher)."""

    kind: Literal["model"]
    """`model`: a model behind a URL plays the environment."""
    model: RemoteModelConfig
    """The model: `{url, name, api_key_env}`."""
    temperature: float = Field(0.0, ge=0)
    """Its sampling temperature."""
    max_tokens: int = Field(512, gt=0)
    """Tokens per reply at most."""
    rollouts: int = Field(64, gt=0)
    """Rollouts the expert plays (one per training task, in the run's task order)."""
    min_reward: float | None = None
    """Only the expert's rollouts with a reward at least this are trained on (null: every one
    that succeeded)."""


class FileExpertConfig(_Section):
    """Demonstrations from a file, in TRL's conversational format: a `messages` column (chat
    messages, tool calls included) and an optional `tools` column (chat tools)."""

    kind: Literal["file"]
    """`file`: transcripts from a file."""
    path: str = Field(min_length=1)
    """A .jsonl, .parquet or .csv file, or a `datasets` folder (relative to the config file, then
    the working directory); each row one conversation."""

    @field_validator("path")
    @classmethod
    def _found(cls, value: str, info: ValidationInfo) -> str:
        base = (info.context or {}).get("base_dir")
        found = near_config(value, base, Path.exists)
        if found is None:
            raise ValueError(not_found(value, base))
        return str(found.resolve())


def _expert_tag(data: Any) -> str | None:
    return data.get("kind") if isinstance(data, dict) else getattr(data, "kind", None)


ExpertConfig = Annotated[
    Annotated[ScriptedExpertConfig, Tag("scripted")] | Annotated[ModelExpertConfig, Tag("model")]
    | Annotated[FileExpertConfig, Tag("file")],
    Discriminator(_expert_tag),
]
"""`warm_start.expert`: where the demonstrations come from, chosen by `kind`."""


class WarmStartConfig(_Section):
    """Optional supervised phase before RL: on the task module's example transcripts (loss on
    every token), or on an expert's demonstrations (`expert`: loss on the expert's replies only,
    in the policy's own tokens; run/expert.py)."""

    steps: int = Field(0, ge=0)
    """Supervised AdamW steps before RL; 0: no warm start. Not run when the run resumes from a
    checkpoint."""
    batch_size: int = Field(64, gt=0)
    """Transcripts per warm-start step (drawn from the `steps * batch_size` the task module
    makes, or from the expert's demonstrations)."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of the warm start (constant, no weight decay, gradient norm clipped
    at 1)."""
    transcripts: str = "warm_start_transcripts"
    """The task module's function that makes them: `fn(n, seed=trainer.seed, **task_args)` returns
    `n` chat transcripts (lists of messages)."""
    expert: ExpertConfig | None = None
    """Demonstrations instead of the task module's transcripts: `{kind: scripted, path:
    expert.py:fn}`, `{kind: model, model: {url, name}}` (each plays `rollouts` rollouts of the
    training tasks through the gateway, recorded in traces.db on engine `expert`), or `{kind:
    file, path: demos.jsonl}`; docs/environments.md."""

    @model_validator(mode="before")
    @classmethod
    def _expert_kind(cls, data: Any) -> Any:
        """An `expert` without a kind this config knows: an error naming `warm_start.expert.kind`."""
        expert = data.get("expert") if isinstance(data, dict) else None
        kinds = list(union_sections(ExpertConfig))
        if isinstance(expert, dict) and expert.get("kind") not in kinds:
            got = f"{expert['kind']!r} is not" if "kind" in expert else "required,"
            raise ValueError(f"warm_start.expert.kind: {got} one of {', '.join(kinds)}")
        return data

    @model_validator(mode="after")
    def _expert_needs_steps(self) -> WarmStartConfig:
        if self.expert is not None and self.steps == 0:
            raise ValueError("warm_start.steps: 0 with warm_start.expert; give the supervised "
                             "steps on its demonstrations (or leave the expert out)")
        return self


class TrainerConfig(_Section):
    """The run: its length, seed, directory, checkpoints, eval passes, devices and metric sinks."""

    steps: int = Field(100, gt=0)
    """Training steps (each: one step's rollouts, then the update)."""
    seed: int = 0
    """Seeds torch and Python, the tiny model's weights, each step's tasks and the agents'
    sampling seeds."""
    reproducible: bool | None = None
    """Batches formed by the agents' progress, not by timing (tracetrain/agents/lockstep.py): an
    engine batch closes when every live agent waits on a model call, its calls in a fixed order;
    so the same config, seed, code, machine and thread counts give the same run: tokens, rewards,
    every metric but measured times, and weights (docs/reproducibility.md says what is and is not
    reproduced). null: on where it applies (engine.kind local, agents in this process or in
    rollout.agent_workers, collect step or overlap), off elsewhere; true: on, an error where it
    cannot be; false: off (a batch closes after a quiet engine.batch_window_ms)."""
    max_staleness: int = Field(0, ge=0)
    """How many versions (updates) old a trained turn may be. `collect: continuous`: the bound the
    collection keeps (nothing is dropped); `collect: step` or `overlap`: rollouts with an older
    trained turn are dropped (counted)."""
    collect: Literal["step", "overlap", "continuous"] = "step"
    """`step`: each step collects its rollouts, then learns. `overlap`: step k+1's rollouts are
    collected while step k's update runs, with the policy before that update (its rollouts are one
    version old, so max_staleness must be >= 1); the engine keeps its own copy of the weights and
    takes the new ones between two collects. `continuous`: agents keep running
    while the policy learns; step s trains `rollout.tasks_per_step` finished groups, the first
    launched first, plus every group launched at a version <= s - max_staleness (after this update
    it would be older than the bound); at most (max_staleness + 1) x tasks_per_step groups are
    launched and not yet trained, and after each update the engine takes the new weights while
    the requests in flight finish first (tracetrain/run/continuous.py). With max_staleness 0 it is
    the `step` run (not with `rollout.agent_workers`). `overlap` and `continuous`: backend
    `embedded`, not with `engine.sleep_level`."""
    max_failed_steps: int = Field(1, ge=0)
    """Stop the run after this many steps in a row in which no rollout succeeded (each failed or
    timed out: the agent raised, the engine refused its calls), before the last of them trains:
    its step line and summary.json's `stopped` say why, with the first failed rollout's error;
    the checkpoint is the last completed step's; `tracetrain train` exits 1 (run/failures.py).
    0: never stop for it."""
    eval_every: int = Field(0, ge=0)
    """Every this many steps, an eval pass: one greedy rollout on each of `eval_tasks` tasks (not
    trained on); 0: no eval pass."""
    eval_tasks: int = Field(64, gt=0)
    """Tasks of an eval pass (with `eval_every`, one pass also runs before the first step: the
    untrained policy's figure, `eval/initial_reward_mean` in step 0's metrics)."""
    target_gain: float = Field(0.3, gt=0)
    """The rise of the 10-step mean training reward that summary.json times: over the first 10
    steps' mean (`target_gain_step`, `target_gain_elapsed_s`) and over the reward of the rollouts
    the untrained policy generated (`reward_untrained`; `untrained_gain_step`,
    `untrained_gain_elapsed_s`)."""
    checkpoint_every: int = Field(0, ge=0)
    """Write a checkpoint every this many steps (besides `checkpoint_minutes`); 0: not by steps.
    One is always written at the end and when a signal stops the run (`stop_grace_s`)."""
    checkpoint_minutes: float = Field(5.0, ge=0)
    """Write a checkpoint at the end of the first step that ends this many minutes after the last
    one (or the run's start): a kill loses at most that much work. 0: not by time. Written by a
    thread while the next step runs (the state copied first); run_dir/checkpoints keeps the last
    `keep_checkpoints`, each with its sha256 (a torn or corrupt one is skipped on resume)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many checkpoints run_dir/checkpoints keeps (the newest also as run_dir/checkpoint.pt)."""
    stop_grace_s: float = Field(20.0, gt=0)
    """SIGTERM / SIGINT: the run stops at its next stop point, writes the checkpoint of its last
    completed step, stops what it started and exits 0; if that takes longer than this many
    seconds (or at a second signal) it ends at once with exit 1 (run/stop.py)."""
    run_dir: str = "runs/default"
    """The run's directory (metrics.jsonl, traces.db, checkpoint.pt, ...); one that holds an
    earlier run is refused unless `resume` is true."""
    resume: bool = False
    """Continue from the checkpoint in `run_dir` (none there: start over in it)."""
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    """Where the policy trains (and the local engine decodes): `cpu`, `cuda` or `cuda:N`."""
    update_threads: int = Field(0, ge=0)
    """Torch threads of the update (the warm start: the larger of this and engine.threads); 0:
    engine.threads."""
    precision: Literal["fp32", "bf16-mixed", "auto"] = "fp32"
    """The training forward passes (warm start, update, reference): `bf16-mixed` runs them under
    torch.autocast(bfloat16) with fp32 weights, optimizer and loss; the engine is not affected.
    `auto`: whichever of the two a forward and backward pass of the model measures faster on this
    machine at the start of the run (logged, and kept by a resumed run). `bf16-mixed` and `auto`
    are for backend `embedded`."""
    report_to: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = Field(default_factory=list)
    """Trackers that also get every step's metrics, the run's config and each eval pass's sample
    rollouts (run/trackers.py; `pip install 'tracetrain[trackers]'`): `tensorboard`
    (run_dir/tensorboard), `wandb` (project `tracetrain`), `trackio` (project `tracetrain`, its
    local store), `mlflow` (experiment `tracetrain`, MLFLOW_TRACKING_URI or ./mlflow.db). One that
    cannot start is named at the start and left out; one that fails later is warned about once:
    training goes on."""

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, v: list[str]) -> list[str]:
        return named_once(v, "a tracker")

    @model_validator(mode="before")
    @classmethod
    def _trackers_by_name(cls, data: Any) -> Any:
        """trainer.tensorboard / trainer.wandb (booleans) are refused, naming report_to."""
        for old in ("tensorboard", "wandb"):
            if isinstance(data, dict) and old in data:
                raise ValueError(f"trainer.{old} is now a name in trainer.report_to: write "
                                 f"`report_to: [{old}]` (also: trackio, mlflow)")
        return data
