"""The typed run configuration's sections: one pydantic model per section, a docstring per key.

Unknown keys and bad values are errors that name the key (`ConfigError`), never ignored or coerced;
validators across sections live on `TrainConfig`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tracetrain import registry
from tracetrain.paths import near_config, not_found
from tracetrain.types import UsageError, check_role


class ConfigError(UsageError):
    """A bad configuration; the message names the key."""


class Registered:
    """Field metadata: the value is a name registered for config key `key` (tracetrain/registry.py;
    docs/config.md lists the names)."""

    def __init__(self, key: str) -> None:
        self.key = key


def registered(key: str) -> Any:
    """The type of a key whose value names a registered piece: a str that must be a registered
    name or an alias, stored as the registered name the alias stands for."""
    return Annotated[str, Registered(key), AfterValidator(lambda name: registry.resolve(key, name))]


class _Section(BaseModel):
    # use_attribute_docstrings: the string literal after a field is its description (docs/config.md)
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True,
                              use_attribute_docstrings=True)


class LoraConfig(_Section):
    """LoRA (peft): train a low-rank adapter on the named linear layers, the base frozen."""

    r: int = Field(16, gt=0)
    """The adapter's rank."""
    alpha: float = Field(32.0, gt=0)
    """Scale: the adapter adds (alpha / r) · B A to each target weight."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (0: the update's forward pass equals the
    engine's)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"], min_length=1)
    """Names of the linear layers that get an adapter (default: attention and MLP projections of
    Llama-family models, SmolLM2 and the tiny model included)."""


class ModelConfig(_Section):
    """Where the policy comes from: a tiny model built from a config, a local path, or a GGUF file."""

    kind: Literal["tiny", "pretrained", "gguf"] = "tiny"
    """`tiny`: a small Llama built offline from the sizes below, with tracetrain's byte-level
    tokenizer; `pretrained`: a transformers directory at `path`; `gguf`: `gguf_file` in `path`,
    loaded dequantized as a plain trainable transformers model. Backend `verl` needs
    `pretrained`."""
    path: str | None = None
    """The pretrained model's directory, or the directory holding the GGUF file; required for
    kinds `pretrained` and `gguf`."""
    gguf_file: str | None = None
    """The GGUF file's name in `path`; required for kind `gguf`."""
    hidden_size: int = Field(128, gt=0)
    """Hidden size of the tiny model (kind `tiny` only)."""
    num_layers: int = Field(4, gt=0)
    """Transformer layers of the tiny model (kind `tiny` only)."""
    num_heads: int = Field(4, gt=0)
    """Attention heads of the tiny model (kind `tiny` only)."""
    num_kv_heads: int = Field(2, gt=0)
    """Key/value heads of the tiny model (grouped-query attention; kind `tiny` only)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The policy's weight dtype: the loaded model is cast to it (a launched vLLM server gets the
    same)."""
    attn_implementation: Literal["sdpa", "eager"] | None = None
    """The attention kernel (transformers' name); null: transformers' default (sdpa). `eager` is
    the fast one for bf16-mixed training on CPU (sdpa's CPU backward in bf16 is several times
    slower)."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of every weight (tracetrain/models/lora.py; needs `peft`, the `lora`
    extra): only the adapter is trained and checkpointed; `run_dir/policy` holds the merged model
    and the adapter (`policy/adapter`). Embedded backend. With engine.kind `vllm` the server is
    launched (`engine.python`) with LoRA enabled on the base weights and each sync loads only the
    adapter (engines/vllm.py); with the local engine, not with `trainer.collect: overlap`. null:
    full fine-tuning."""

    @model_validator(mode="after")
    def _needs_path(self) -> ModelConfig:
        if self.kind in ("pretrained", "gguf") and not self.path:
            raise ValueError(f"model.path is required when model.kind is {self.kind!r}")
        if self.kind == "gguf" and not self.gguf_file:
            raise ValueError("model.gguf_file is required when model.kind is 'gguf'")
        return self


class WarmStartConfig(_Section):
    """Optional supervised phase before RL (loss on every token of example transcripts)."""

    steps: int = Field(0, ge=0)
    """Supervised AdamW steps before RL; 0: no warm start. Not run when the run resumes from a
    checkpoint."""
    batch_size: int = Field(64, gt=0)
    """Transcripts per warm-start step (drawn from the `steps * batch_size` the task module
    makes)."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of the warm start (constant, no weight decay, gradient norm clipped
    at 1)."""
    transcripts: str = "warm_start_transcripts"
    """The task module's function that makes them: `fn(n, seed=trainer.seed, **task_args)` returns
    `n` chat transcripts (lists of messages)."""


class DataConfig(_Section):
    """Tasks from a dataset file instead of the task module's `tasks` function (agents/dataset.py): each
    row is one task, handed to the agent as a dict; the agent and reward stay in the task
    module."""

    train: str | None = None
    """The training rows: a .jsonl, .parquet or .csv file or a `datasets.save_to_disk` folder
    (relative to the config file, then the working directory); null: the task module makes the
    tasks."""
    eval: str | None = None
    """Held-out rows for the eval passes, in the same formats; null: `eval_fraction` of `train`
    (or, with neither, the task module's tasks)."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    """Without `eval`: this share of the `train` rows is held out (drawn with `split_seed`),
    never trained on, and the eval passes use it."""
    split_seed: int = 0
    """The seed of the held-out draw (kept apart from trainer.seed: another training seed keeps
    the same split)."""
    shuffle: bool = True
    """Each epoch deals the train rows in a new order drawn from (trainer.seed, epoch); false: file
    order every epoch."""
    fields: list[str] = Field(default_factory=list)
    """Fields every row must have (checked for all rows before training: an error names the
    file, the row and the field)."""

    @model_validator(mode="after")
    def _needs_train(self) -> DataConfig:
        if self.eval is not None and self.eval_fraction:
            raise ValueError("data.eval_fraction: give it or data.eval, not both")
        return self


def _object_spec(value: str, info: ValidationInfo) -> str:
    """`module:name` as given; `path.py:name` with the path made absolute (relative to the config
    file, then the working directory), so worker processes and Ray find the same file."""
    target, sep, name = value.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{value!r} is not of the form 'module:name' or 'path/to/file.py:name'")
    if target.endswith(".py") and not Path(target).is_absolute():
        base = (info.context or {}).get("base_dir")
        found = near_config(target, base, Path.is_file)
        if found is None:
            raise ValueError(not_found(target, base))
        return f"{found.resolve()}:{name}"
    return value


ObjectSpec = Annotated[str, AfterValidator(_object_spec)]
"""A Python object named `module:name` or `file.py:name` (the file relative to the config file)."""


class ReasoningGymPart(_Section):
    """One dataset of a reasoning-gym composite."""

    weight: float = Field(1.0, gt=0)
    """Its share of the rows (weights are normalised)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Its config options (the fields of the dataset's own config class)."""


class ReasoningGymConfig(_Section):
    """Tasks from reasoning-gym (tracetrain/envs/reasoning_gym.py): `size` rows generated from
    `seed`; each entry's `question` is the prompt and the dataset's own `score_answer` the reward.
    `data.eval_fraction` holds rows out as for a dataset file."""

    dataset: str | None = None
    """A reasoning-gym dataset name (`reasoning_gym.factory.DATASETS`); or give `datasets`."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The dataset's config options (with `dataset`)."""
    datasets: dict[str, ReasoningGymPart] | None = None
    """A composite: dataset name -> {weight, config}; each row drawn from one by weight."""
    size: int = Field(1000, gt=0)
    """Rows generated (train and held-out together)."""
    seed: int = 0
    """The generator's seed: the same seed, the same rows."""
    system_prompt: str = "default"
    """A name of `reasoning_gym.utils.SYSTEM_PROMPTS` (default, simple, direct, DeepSeekZero,
    chain_of_draft), or the system message's text; empty: no system message."""
    answer: str = "tags"
    """How the answer is read from the model's reply: `tags`, the last <answer>...</answer>
    (reasoning_gym.utils.extract_answer); `last_line`, the last non-empty line; `last_number`, the
    last number (a small chat model answers "The answer is 7."); `whole`, the whole reply
    stripped; or `module:function` / `file.py:function`, fn(reply: str) -> str | None."""

    @model_validator(mode="after")
    def _one_source(self) -> ReasoningGymConfig:
        if (self.dataset is None) == (self.datasets is None):
            raise ValueError("env.reasoning_gym: give `dataset` (one) or `datasets` (a composite)")
        if self.datasets is not None and self.config:
            raise ValueError("env.reasoning_gym.config: with `datasets`, each part has its config")
        if self.datasets is not None and not self.datasets:
            raise ValueError("env.reasoning_gym.datasets: empty")
        return self

    @field_validator("answer")
    @classmethod
    def _answer(cls, value: str, info: ValidationInfo) -> str:
        if value in ("tags", "last_line", "last_number", "whole"):
            return value
        return _object_spec(value, info)


class VerifiersConfig(_Section):
    """A verifiers environment (tracetrain/envs/verifiers_env.py), played as it is: its dataset,
    its rollout or harness, its rubric's reward (docs/environments.md)."""

    env_id: str = Field(min_length=1)
    """The environment: classic, the id `verifiers.load_environment(env_id, **args)` loads (a
    module named by the id, with `load_environment`); `verifiers.v1`, the taskset id (a module
    exporting its `Taskset`, and for several agents its `Env`, in `__all__`)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Classic: keyword arguments of its `load_environment`. v1: the env config (what `vf-eval`'s
    `--env.*` sets, nested: `taskset: {...}`, `agent: {harness: {id: null}}`, `id` of a paired
    env); an agent whose `runtime` is not given runs as a local subprocess."""
    api: Literal["auto", "classic", "v1"] = "auto"
    """`classic`: the 0.3 `load_environment` API (`Environment.rollout`, its rubric); `v1`: 0.4's
    `verifiers.v1` (Taskset, Harness, `Env.run_episode`), always in a worker process; `auto`: by
    what the module is (a `load_environment` function: classic), in the interpreter used."""
    python: str | None = Field(None, min_length=1)
    """The interpreter of a venv holding verifiers (`bash scripts/install-verifiers.sh`:
    .venv-verifiers/bin/python), where its pins conflict with tracetrain's: the environment runs
    in a worker process there (a path relative to the config file, then the working directory, or
    a command on PATH). null: this interpreter (classic in-process, v1 in a worker)."""
    path: list[str] = Field(default_factory=list)
    """Folders searched first for the environment's module (sys.path, and the worker's
    PYTHONPATH), relative to the config file, then the working directory."""
    max_rows: int | None = Field(None, gt=0)
    """The first `max_rows` rows of the environment's dataset (and of its eval dataset) only;
    null: all (an infinite v1 taskset needs it)."""

    @field_validator("python")
    @classmethod
    def _python(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or "/" not in value:
            return value  # a command looked up on PATH when the worker starts
        return str(near_config(value, (info.context or {}).get("base_dir")) or value)

    @field_validator("path")
    @classmethod
    def _path(cls, value: list[str], info: ValidationInfo) -> list[str]:
        out = []
        for folder in value:
            found = near_config(folder, (info.context or {}).get("base_dir"), Path.is_dir)
            if found is None:
                raise ValueError(f"no folder {folder!r} (relative to the config file, then the "
                                 "working directory)")
            out.append(str(found))
        return out


class OpenEnvConfig(_Section):
    """An OpenEnv environment (tracetrain/envs/openenv.py): one client session per rollout, played
    as an environment class whose one tool, `step`, takes the fields of the environment's Action;
    each step's reward is the reward of the model call that made it, the rollout's reward their
    sum. The tasks: data.train's rows, or `size` rows {"seed": seed + i}; each row goes to reset."""

    client: ObjectSpec
    """The environment's `EnvClient` subclass, `module:Class` or `file.py:Class` (its Action type
    is read from its generic parameters; `openenv.core.GenericEnvClient`: from the server's
    /schema)."""
    app: ObjectSpec | None = None
    """The environment's FastAPI app (`module:app`, made by openenv's `create_app`), served by
    tracetrain in each process that plays it, on 127.0.0.1 at a free port; or give `base_url`."""
    base_url: str | None = Field(None, pattern=r"^(https?|wss?)://[^/?#\s]+(/[^?#\s]*)?$")
    """A running environment server."""
    size: int | None = Field(None, gt=0)
    """Without data.train: the number of task rows, row i being {"seed": seed + i} (handed to the
    server's reset, which takes the keys its signature names). null: data.train's rows."""
    seed: int = 0
    """The first row's seed (with `size`)."""
    observation: ObjectSpec | None = None
    """`fn(observation) -> str`: the text the model gets for an observation (reset's and each
    step's); null: the observation's own fields but done/reward/metadata, as JSON (a lone string
    field: its text)."""
    max_turns: int = Field(8, gt=0)
    """Model calls per rollout at most."""
    system_prompt: str | None = None
    """The system message (null: none)."""

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvConfig:
        if (self.app is None) == (self.base_url is None):
            raise ValueError("env.openenv: give `app` (served in-process) or `base_url` (a running server)")
        return self


class EnvironmentClassConfig(_Section):
    """A TRL-style environment class (`environment_factory`, tracetrain/envs/tools.py): one
    instance per rollout, `reset(**row)` from the task's dataset row, its public methods the
    model's tools, the reward functions given the instances."""

    factory: ObjectSpec
    """The class (or a function returning an instance), `module:Class` or `file.py:Class`."""
    reward_funcs: list[ObjectSpec] = Field(default_factory=list)
    """Reward functions in TRL's form, `fn(prompts, completions, environments=..., **row columns)
    -> list[float | None]` (a list of one); the rollout's reward is their sum, plus the
    instance's `get_reward()` when its class defines one (TRL 1.16). With neither: the instance's
    `reward` attribute."""
    max_turns: int = Field(8, gt=0)
    """Model calls per rollout at most."""
    system_prompt: str | None = None
    """The system message (null: none)."""


class EnvConfig(_Section):
    """Tasks, turns and rewards from an environment standard (docs/environments.md), instead of
    a task module: give exactly one section."""

    reasoning_gym: ReasoningGymConfig | None = None
    """A reasoning-gym dataset (or a composite of several)."""
    verifiers: VerifiersConfig | None = None
    """A verifiers environment (the classic API or `verifiers.v1`)."""
    openenv: OpenEnvConfig | None = None
    """An OpenEnv environment (its server in-process, or running)."""
    environment_class: EnvironmentClassConfig | None = None
    """A TRL-style environment class (`environment_factory`)."""

    @property
    def kind(self) -> str:
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvConfig:
        given = [k for k in type(self).model_fields if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"env: give exactly one of {', '.join(type(self).model_fields)} "
                             f"(got {given or 'none'})")
        return self


class RolloutConfig(_Section):
    """How each step's rollouts are collected: tasks, group size, concurrency, and the sampling
    settings handed to the agents."""

    tasks_per_step: int = Field(16, gt=0)
    """Tasks per training step, from the task module's `tasks(n, seed=...)`."""
    n_per_task: int = Field(8, gt=0)
    """Rollouts per task: the group size of the advantage estimators."""
    concurrency: int = Field(256, gt=0)
    """Most agents running at once."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds an agent may take for one rollout; past it the rollout is `timed_out` (a command
    agent is killed)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature handed to each agent (`client["temperature"]`); the trainer's
    logprobs are computed at the same temperature. Eval passes use 0 (greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling, handed to each agent (`client["top_p"]`): each token is drawn from the
    most likely tokens whose mass before it is < top_p, renormalised. The engine records, and the
    trainer computes, the token's logprob p under the full temperature-scaled distribution (the
    PPO ratio is 1 on-policy): the tokens come from the nucleus (mass S), the update
    differentiates log p, a bias of E[A sum_t grad log S_t] against the truncated policy's own
    gradient (none at 1; tracetrain/engines/sampling.py). < 1 only with engine.kind `local` (or
    correction.old `trainer` and no correction): vLLM's logprobs are renormalised over the
    nucleus."""
    max_tokens: int = Field(16, gt=0)
    """Response-token limit of one model call, handed to each agent (`client["max_tokens"]`)."""
    agent_workers: int = Field(0, ge=0)
    """0: agents on the trainer's event loop; k: in k processes (tracetrain/agents/workers.py)."""


class AggregateConfig(_Section):
    """How the turns of finished rollouts become training rows (tracetrain/rows/aggregate.py)."""

    level: Literal["trajectory", "transition"] = "trajectory"
    """`trajectory`: a rollout's turns join one row while each prompt extends the previous context
    (a break, or the length limit, starts a new row); `transition`: one row per turn."""
    max_prompt_length: int = Field(512, gt=0)
    """Tokens a row's prompt may hold; a longer one is handled by `overlong`."""
    max_response_length: int = Field(512, gt=0)
    """Tokens a row's response region may hold (at the trajectory level: its turns' observations
    and responses); a single response over it is handled by `overlong`."""
    overlong: Literal["drop_rollout", "truncate"] = "drop_rollout"
    """`drop_rollout`: the whole rollout leaves the batch (counted per cause); `truncate`: the
    prompt keeps its last `max_prompt_length` tokens, the response its first
    `max_response_length`."""


class RolesConfig(_Section):
    """The agents of a program: each call's role is the request's `model` or a role's base URL
    (tracetrain/rows/roles.py, docs/agents.md)."""

    train: list[str] | None = None
    """The roles whose calls are trained; null: every role. A role left out is still served,
    recorded and counted, and contributes no trained token."""
    serve: dict[str, str] = Field(default_factory=dict)
    """Which engine answers a role's calls (a role not named here: the policy's): `policy`;
    `frozen`, a copy of the policy as it was when training started (engine.kind local), never
    updated; or the name of an engine registered with the gateway (e.g. an upstream server). A
    role served by another engine must not train: name the roles that train in `train`."""

    @field_validator("train")
    @classmethod
    def _role_names(cls, v: list[str] | None) -> list[str] | None:
        for role in v or ():
            check_role(role)  # (a TraceError is a ValueError: pydantic reports it)
        return v

    @field_validator("serve")
    @classmethod
    def _served_roles(cls, v: dict[str, str]) -> dict[str, str]:
        for role, engine in v.items():
            check_role(role)  # (a TraceError is a ValueError: pydantic reports it)
            if not engine:
                raise ValueError(f"role {role!r}: the engine name is empty")
        return v

    @model_validator(mode="after")
    def _served_elsewhere_do_not_train(self) -> RolesConfig:
        elsewhere = sorted(r for r, e in self.serve.items() if e != "policy")
        if elsewhere and self.train is None:
            raise ValueError(f"roles.serve gives {elsewhere} another engine than the policy: name "
                             "the roles that train in roles.train (it is every role by default)")
        both = sorted(set(elsewhere) & set(self.train or ()))
        if both:
            raise ValueError(f"roles {both} are in roles.train but served by another engine than "
                             "the policy (roles.serve): their tokens would not be the policy's")
        return self


class AdvantageConfig(_Section):
    """The advantage each trained token carries: its rollout's (tracetrain/objective/advantage.py) or its
    turn's (tracetrain/objective/credit.py)."""

    estimator: registered("advantage.estimator") = "grpo"
    """Per rollout, from its final reward: `grpo`: (r - group mean) / (group std + eps);
    `dr-grpo`: r - group mean; `rloo`: r - mean of the group's others; `reinforce++`: r - group
    mean, over the batch std of those + eps. Per turn, with turn rewards: `return-to-go`: the
    turn's discounted turn rewards from it on plus the final reward, normalised in its group;
    `gigpo`: grpo on the episode's return plus `step_weight` times the turn's discounted turn
    rewards normalised among the group's turns from the same prompt. Or an estimator registered
    by a module of `plugins` (docs/architecture.md, "Adding a piece")."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of later turn rewards per turn (`return-to-go`, `gigpo`)."""
    step_weight: float = Field(1.0, ge=0)
    """Weight of the step-level advantage in `gigpo`."""
    failed_rollouts: Literal["exclude", "zero_reward"] = "exclude"
    """Failed and timed-out rollouts: `exclude` them before grouping (no advantage, no effect on
    their group's mean), or train them with reward 0 (`zero_reward`)."""
    eps: float = Field(1e-6, gt=0)
    """Added to the standard deviation the advantage is divided by (grpo, reinforce++)."""


class LossConfig(_Section):
    """The PPO objective and how its tokens are weighted (tracetrain/objective/loss.py, docs/objective.md)."""

    mode: registered("loss.mode") = "rollout-mean"
    """Token weights of the loss: `rollout-mean` every rollout counts the same (alias
    `per_rollout_mean`, Agent Lightning's name; the config stores `rollout-mean`); `token-mean`
    every token; `seq-mean-token-mean` every row; `seq-mean-token-sum` token sums averaged over
    rows; `seq-mean-token-sum-norm` the same divided by `norm_length` (docs/objective.md); or a
    mode registered by a module of `plugins`."""
    norm_length: float | None = Field(None, gt=0)
    """The constant token count `seq-mean-token-sum-norm` divides by: required for that mode,
    refused by the loss for the others."""
    clip_low: float = Field(0.2, ge=0)
    """PPO clip of the probability ratio below: at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """PPO clip of the probability ratio above: at 1 + clip_high."""
    dual_clip: float | None = Field(3.0, gt=1)
    """Dual-clip PPO: a token with a negative advantage A loses at most |A| * dual_clip; null: no
    cap."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the per-token KL to a reference policy (a frozen copy of the policy after the warm
    start); 0: no KL term and no reference model."""
    kl_estimator: registered("loss.kl_estimator") = "k3"
    """Schulman's KL estimators, with x = ref - logprob: `k1` -x; `k2` x^2 / 2; `k3` exp(x) - x - 1
    (clamped as verl's low_var_kl)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss); 0: the entropy is not computed."""


class CorrectionConfig(_Section):
    """Importance corrections between the engine's sampling and the trainer's policy
    (tracetrain/objective/correction.py, docs/objective.md "Importance corrections"). Embedded backend."""

    old: Literal["engine", "trainer"] = "engine"
    """What the PPO ratio is taken against: `engine`, the logprobs the engine recorded for each
    token (its turn's model version); `trainer`, the proximal policy: the trainer's own logprobs
    under the weights before the step's first update (one no-grad forward over the step's rows),
    the decoupled PPO of AReaL. The corrections below need `trainer`."""
    weight: registered("correction.weight") = "none"
    """Truncated importance weight on each token's PPO term: `token`, min(pi/mu, cap) per token;
    `rollout`, min(prod pi/mu, cap) over all the rollout's trained tokens in all its rows."""
    cap: float = Field(2.0, ge=1)
    """The truncation C of `weight`."""
    mask: registered("correction.mask") = "none"
    """Masked IS: `token`, tokens whose pi/mu is outside `band` get no PPO term (IcePop);
    `rollout`, every token of a rollout whose per-token geometric mean of pi/mu is outside it."""
    band: list[float] = Field(default_factory=lambda: [0.5, 2.0])
    """[lo, hi] of `mask`, with lo <= 1 <= hi."""
    reject: list[float] | None = None
    """[lo, hi]: a rollout whose per-token geometric mean of pi/mu is outside it is taken out of
    the update (counted; R counts the kept rollouts); null: none is."""

    @field_validator("band", "reject")
    @classmethod
    def _band(cls, v: list[float] | None, info) -> list[float] | None:
        if v is not None and (len(v) != 2 or not 0 < v[0] <= 1 <= v[1]):
            raise ValueError(f"{info.field_name}: [lo, hi] with 0 < lo <= 1 <= hi, got {v}")
        return v

    @model_validator(mode="after")
    def _needs_trainer(self) -> CorrectionConfig:
        on = [k for k, v in (("weight", self.weight != "none"), ("mask", self.mask != "none"),
                             ("reject", self.reject is not None)) if v]
        if on and self.old != "trainer":
            raise ValueError(f"correction.{on[0]}: corrects the trainer's proximal policy against the "
                             "engine's; set correction.old: trainer (the ratio taken against it)")
        return self


class OptimConfig(_Section):
    """AdamW, its learning-rate schedule, and how a step's update is cut
    (tracetrain/objective/minibatch.py)."""

    lr: float = Field(5e-4, gt=0)
    """AdamW learning rate (after the warm-up)."""
    warmup_steps: int = Field(10, ge=0)
    """Linear learning-rate warm-up, in training steps."""
    decay: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate decay after the warm-up, to 0 at the last of `trainer.steps` (backend `verl`:
    constant or cosine)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's (decoupled) weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient norm clip of each optimizer update."""
    mini_batches: int = Field(1, gt=0)
    """Optimizer updates per PPO epoch: mini-batches of whole rollouts, balanced by tokens
    (backend `verl`: it must divide `rollout.tasks_per_step`)."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over a step's rollouts."""
    micro_batch_tokens: int = Field(65536, gt=0)
    """Token budget of one micro-batch (gradients accumulate over a mini-batch's micro-batches;
    backend `verl`: per GPU). With `pack_rows` the tokens counted are the ones computed (a
    shared prefix once) and the budget is also capped by `pack_tokens`."""
    pack_rows: bool = True
    """Embedded backend: each micro-batch's rows go into one sequence, without padding, attention
    never crossing rows (tracetrain/learn/packing.py); false: the rows padded to a rectangle."""
    share_prefixes: bool = True
    """With `pack_rows`: tokens that rows share from their start (the step's system prompt, a
    group's question, a rollout's earlier turns) are computed once in the forward and backward;
    the loss and gradients are the same up to float reassociation."""
    pack_tokens: int | None = Field(None, gt=0)
    """With `pack_rows`: the most tokens one packed micro-batch computes. Its attention mask is
    dense on the CPU (cost N^2), so packs are kept short; null: 4 x the model's hidden size."""
    logprob_chunk: int = Field(512, ge=0)
    """Embedded backend: response positions per lm_head chunk when computing logprobs (the logits
    held at once are [chunk, vocab], recomputed in the backward); 0: all at once."""


# peft names the rows of a batch without an adapter "__base__"; an adapter's name must not be
# part of its layers' prefix "lora_" (peft would take its weights for a layer's on loading).
RESERVED_POLICY_NAMES = ("__base__",)
POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # (an adapter's name is a module key)


class PolicyConfig(_Section):
    """One of several policies of a run (`policies`): a LoRA adapter on the run's base model
    (`model`), or a whole model of its own, making its roles' calls and learning from their
    trained tokens only, with its own optimizer and learning-rate schedule (docs/policies.md)."""

    roles: list[str] = Field(min_length=1)
    """The roles whose calls this policy makes and learns from; a role belongs to one policy at
    most (a role of none is served by the base model, without an adapter, and does not train)."""
    lora: LoraConfig | None = Field(default_factory=LoraConfig)
    """Its adapter on the run's base model (rank, alpha, target layers); null: a whole model of
    its own, every weight trained: `model`, or without it a copy of the run's model as RL starts
    (after the warm start, which trains the model every policy starts from)."""
    model: ModelConfig | None = None
    """Its own model (a whole model, every weight trained; `lora` is then null unless given);
    the tokenizer must be the run's model's. null: `lora` on the run's model, or its copy."""
    lr: float | None = Field(None, gt=0)
    """Its AdamW learning rate; null: `optim.lr`."""
    warmup_steps: int | None = Field(None, ge=0)
    """Its learning-rate warm-up; null: `optim.warmup_steps`."""
    decay: Literal["constant", "cosine", "linear"] | None = None
    """Its learning-rate decay; null: `optim.decay`."""
    weight_decay: float | None = Field(None, ge=0)
    """Its weight decay; null: `optim.weight_decay`."""
    grad_clip: float | None = Field(None, gt=0)
    """Its gradient norm clip; null: `optim.grad_clip`."""
    kl_coef: float | None = Field(None, ge=0)
    """Its KL penalty against the base model; null: `loss.kl_coef`."""

    @field_validator("roles")
    @classmethod
    def _role_names(cls, v: list[str]) -> list[str]:
        for role in v:
            check_role(role)
        if len(set(v)) != len(v):
            raise ValueError(f"a role named twice: {v}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _own_model_is_whole(cls, data: Any) -> Any:
        """`model` without `lora`: the model whole (the adapter's default is not meant)."""
        if isinstance(data, dict) and data.get("model") is not None and "lora" not in data:
            return {**data, "lora": None}
        return data

    @property
    def whole(self) -> bool:
        """A whole model of its own (`model`, or a copy of the run's), not an adapter."""
        return self.lora is None


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
        if len(set(v)) != len(v):
            raise ValueError(f"a tracker named twice: {v}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _trackers_by_name(cls, data: Any) -> Any:
        """trainer.tensorboard / trainer.wandb (booleans) are refused, naming report_to."""
        for old in ("tensorboard", "wandb"):
            if isinstance(data, dict) and old in data:
                raise ValueError(f"trainer.{old} is now a name in trainer.report_to: write "
                                 f"`report_to: [{old}]` (also: trackio, mlflow)")
        return data


WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # every interface: an address to bind, not one to reach


class GatewayConfig(_Section):
    """Where the trainer's gateway listens and the URL its agents are given. The default keeps it
    on loopback. For agents on other hosts (Ray workers, sandboxes): `host` an interface address
    or a wildcard (0.0.0.0, ::), `public_url` the base URL they reach it at (a TLS proxy in front
    of it, say); `{port}` in it stands for the bound port. Off loopback the admin key must come
    from $TRACETRAIN_ADMIN_KEY; agents always need their rollout's own key. `context`: how chat
    prompts are built, `exact` (the earlier turn's ids + the new messages) or `template` (the chat
    template's full render); docs/gateway.md. `tool_parser`: the format of the model's tool calls
    (auto: detected from the chat template)."""

    host: str = Field("127.0.0.1", min_length=1)
    """The address the gateway binds: loopback, an interface address, or a wildcard (0.0.0.0, ::;
    then `public_url` is required)."""
    port: int = Field(0, ge=0, le=65535)
    """The port it binds; 0: a free port."""
    public_url: str | None = Field(None, pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")
    """The base URL agents are given; `{port}` stands for the bound port. null: http://HOST:PORT
    for an interface address, the loopback URL on loopback."""
    context: Literal["exact", "template"] = "exact"
    """How chat prompts are built: `exact` (the earlier turn's ids + the new messages) or
    `template` (the chat template's full render); docs/gateway.md."""
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    """The format of the model's tool calls; `auto`: detected from the chat template."""
    forced_tool_choice: Literal["refuse", "as_auto"] = "refuse"
    """A request's tool_choice that forces a call (`required`, a named tool) where it cannot be
    enforced (the local engine, SGLang, the mistral tool parser; a vLLM engine constrains decoding
    to the call instead): `refuse` answers 400; `as_auto` generates it as `auto` (smolagents'
    ToolCallingAgent asks for `required`)."""

    @field_validator("public_url")
    @classmethod
    def _only_port_in_braces(cls, url: str | None) -> str | None:
        if url is not None and ("{" in url.replace("{port}", "") or "}" in url.replace("{port}", "")):
            raise ValueError("only '{port}' (the bound port) may stand in braces")
        return url


class _EngineKeys(_Section):
    """The keys of every engine kind."""

    kind: str
    threads: int = Field(0, ge=0)
    """Torch intra-op threads of the trainer's process: the local engine's decode thread (a
    plugin's starter is handed the count too), and the update unless trainer.update_threads
    says otherwise; 0: torch's default."""


class _LocalKeys(_EngineKeys):
    """The keys of an engine that decodes in the trainer's process."""

    batch_window_ms: float = Field(2.0, ge=0)
    """Batch gathering: a batch closes after a quiet `batch_window_ms` (the loop awake, no
    request)."""
    prefix_cache_mb: int = Field(1024, ge=0)
    """The prefix cache's memory budget (engines/prefix_cache.py: the KV of every shared prompt
    prefix, per model version and adapter, least recently used out); 0: nothing kept between
    batches (a batch's shared prefixes are still computed once)."""
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    """The local engine's forward passes (engines/precision.py): `fp32`, on the trainer's weights
    themselves; `bf16`, with a bfloat16 copy of it (weights and KV in bf16, refreshed after every
    update): about half a decode step's time on a CPU with bf16 units, logprobs that differ from
    the trainer's by bf16 rounding (engine/logprob_gap_*; correction.old trainer with a
    correction.weight corrects for it); `auto`, bf16 where a decode step measures at least 10 %
    faster in it, else fp32."""
    compile: bool = False
    """A decode step of a Llama-family model (llama, qwen2) runs as one function of tensors
    (engines/decode_graph.py: eagerly, transformers' logits bit for bit without its per-layer
    overhead); `true` compiles it with torch.compile (inductor's CPU backend, gcc), eager where
    that fails: ~1.1x faster a step again (SmolLM2-135M on a 2-core Zen 4), for ~1 min of
    compiling at the first batch (seconds once inductor's disk cache has it) and logprobs that
    differ from eager's by rounding (docs/benchmarks.md)."""


class _ServerKeys(_EngineKeys):
    """The keys of a vLLM server."""

    base_url: str | None = Field(None, pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")
    """A running vLLM server (started with VLLM_SERVER_DEV_MODE=1) the new weights are pushed to
    (not with `python`)."""
    python: str | None = Field(None, min_length=1)
    """The interpreter of the venv that has vLLM: tracetrain launches the server with it (not
    with `base_url`)."""
    args: list[str] = Field(default_factory=list)
    """Extra arguments of the server tracetrain launches (`python`)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of a launched server (`python`), on top of this process's (e.g.
    VLLM_CPU_OMP_THREADS_BIND)."""
    sync: Literal["disk", "nccl"] = "disk"
    """How new weights reach the server: `disk`, a Hugging Face directory and vLLM's
    reload_weights (CPU or GPU, the server on this machine); `nccl`, vLLM's NCCL weight-transfer
    engine (CUDA GPUs)."""
    sleep_level: Literal[0, 1, 2] = 0
    """One GPU for vLLM and the trainer: the server sleeps during each update (1: weights to CPU
    memory, KV cache dropped; 2: both dropped, the sync brings new weights); 0: never (CUDA only).
    For a server tracetrain launches (`python`); not with `trainer.collect` overlap or
    continuous."""
    start_timeout_s: float = Field(600.0, gt=0)
    """Seconds until the server answers /health (a launched one: from its launch)."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Seconds one request to the server may take."""
    max_model_len: int | None = Field(None, gt=0)
    """The server's context (prompt + response tokens); null: aggregate's prompt + response
    lengths."""


class LocalEngineConfig(_LocalKeys):
    """`local` (the default): the trainer's own transformers loop, in this process."""

    kind: Literal["local"] = "local"
    """`local`: the trainer's own transformers loop, in this process."""


class VllmEngineConfig(_ServerKeys):
    """`vllm`: a vLLM server, either one already running at `base_url` (started with
    VLLM_SERVER_DEV_MODE=1, on this machine's files for `sync: disk`), or one tracetrain launches
    with `python` (the interpreter of the venv that has vLLM, scripts/install-vllm.sh) and `args`
    (extra server arguments), on the initial policy written as a Hugging Face directory; it is
    stopped at the end and its log kept in the run dir. After every update the new weights are
    pushed to it (engines/vllm.py)."""

    kind: Literal["vllm"] = "vllm"
    """`vllm`: a vLLM server (one of `base_url` and `python`)."""

    @model_validator(mode="after")
    def _one_server(self) -> VllmEngineConfig:
        if (self.base_url is None) == (self.python is None):
            raise ValueError("engine.python: engine.kind 'vllm' needs either engine.base_url (a "
                             "running server) or engine.python (the interpreter tracetrain "
                             "launches vLLM with), not both")
        if self.sleep_level and self.base_url is not None:
            raise ValueError("engine.sleep_level: for a server tracetrain launches (it adds "
                             "--enable-sleep-mode); start yours with it and use engine.python")
        if self.base_url is not None and (self.args or self.env):
            key = "args" if self.args else "env"
            raise ValueError(f"engine.{key}: for a server tracetrain launches (engine.python); a "
                             "running server at engine.base_url has its own")
        return self


class PluginEngineConfig(_LocalKeys, _ServerKeys):
    """A plugin's kind (one registered by a module of `plugins`, engines/start.py): it takes the
    keys of both kinds above, unchecked, for its starter to read."""

    kind: registered("engine.kind")
    """Or a kind registered by a module of `plugins` (engines/start.py)."""


def _engine_tag(data: Any) -> str:
    """The model of an `engine` section: its kind's (none given: `local`), `plugin` for a kind a
    plugin registered."""
    kind = data.get("kind", "local") if isinstance(data, dict) else getattr(data, "kind", "local")
    return kind if kind in ("local", "vllm") else "plugin"


EngineConfig = Annotated[
    Annotated[LocalEngineConfig, Tag("local")] | Annotated[VllmEngineConfig, Tag("vllm")]
    | Annotated[PluginEngineConfig, Tag("plugin")],
    Discriminator(_engine_tag),
]
"""The `engine` section: one model per kind, chosen by `kind` (absent: `local`); a key of another
kind is an error naming it."""


def union_sections(annotation: Any) -> dict[str, type[BaseModel]]:
    """{tag: model} of a field typed as a tagged union of sections (`engine`), else {}."""
    import typing

    if typing.get_origin(annotation) is Annotated:  # the Discriminator around it
        annotation = typing.get_args(annotation)[0]
    out = {}
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is not Annotated:
            return {}
        model, *meta = typing.get_args(arg)
        tag = next((m.tag for m in meta if isinstance(m, Tag)), None)
        if tag is None or not (isinstance(model, type) and issubclass(model, BaseModel)):
            return {}
        out[tag] = model
    return out


class VerlConfig(_Section):
    """`verl:` section of a tracetrain config (used when `backend: verl`)."""

    nnodes: int = Field(1, ge=1)
    n_gpus_per_node: int = Field(8, ge=1)
    strategy: Literal["fsdp", "fsdp2"] = "fsdp2"
    rollout: Literal["vllm", "sglang"] = "vllm"  # verl's rollout server; the gateway calls it
    rollout_tp: int = Field(1, ge=1)  # tensor parallel size of one rollout replica
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    param_offload: bool = False
    optimizer_offload: bool = False
    gradient_checkpointing: bool = True
    use_remove_padding: bool = True  # packed sequences (needs flash-attn on the GPUs)
    ray_address: str | None = None  # None: start a local Ray (or join RAY_ADDRESS if set)
    # dotted verl config keys, applied last ("+key" adds a key verl's yaml does not have)
    overrides: dict[str, Any] = Field(default_factory=dict)


class TrainConfig(_Section):
    """A whole run. `task` is a task module (a .py path relative to the config file, or a module
    name) with `tasks(n, seed=...)`, the agent function named by `agent`, and optionally the
    warm-start transcripts function named by `warm_start.transcripts`."""

    plugins: list[str] = Field(default_factory=list)
    """Modules imported before the rest of the config is checked, so that the names they register
    (advantage estimators, loss modes, KL estimators, corrections, engine kinds: docs/architecture.md,
    "Adding a piece") are accepted: each a module name or a .py path (relative to the config file,
    then the working directory; stored as its absolute path). Every process that builds the config
    imports them (the trainer, each DDP rank, the viewer). Backend `embedded`."""
    task: str = "examples/guess/task.py"
    """The task module: a .py path (relative to the config file, then the working directory) or a
    module name."""
    task_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the task module's `tasks` (and warm-start transcripts) function."""
    agent: str = "agent"
    """The task module's agent function (or a `module:function` or a command, see
    runner.load_agent)."""
    backend: Literal["embedded", "verl"] = "embedded"
    """Who trains: `embedded`, tracetrain's own trainer in this process (or under torchrun);
    `verl`, verl's FSDP actor and rollout servers on Ray (docs/scaling.md)."""
    runner: Literal["local", "ray"] = "local"
    """Where the agents run: `local`, in this process (or `rollout.agent_workers` processes);
    `ray`, as Ray tasks (RAY_ADDRESS, else a local Ray)."""
    env: EnvConfig | None = None
    """An environment standard as the task source (docs/environments.md); null: the task module."""
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    aggregate: AggregateConfig = Field(default_factory=AggregateConfig)
    roles: RolesConfig = Field(default_factory=RolesConfig)
    policies: dict[str, PolicyConfig] | None = None
    """Several policies in one run, by name: each a LoRA adapter on `model` with its roles and
    optimizer (docs/policies.md); null: one policy, the whole model (or `model.lora`)."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    engine: EngineConfig = Field(default_factory=LocalEngineConfig)
    """What generates the rollouts, chosen by `engine.kind`: each kind takes its own keys (the
    table marks the keys of some kinds only; one given to another kind is an error). For backend
    `embedded` only."""
    verl: VerlConfig = Field(default_factory=VerlConfig)
    """For backend `verl` only."""

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any, info: ValidationInfo) -> Any:
        """Import `plugins` first: the keys below are checked against what they register."""
        plugins = data.get("plugins") if isinstance(data, dict) else None
        if isinstance(plugins, list) and all(isinstance(p, str) for p in plugins):
            # a .py path is kept absolute: the run's config.json is read from elsewhere
            data = {**data, "plugins": registry.import_plugins(plugins, (info.context or {}).get("base_dir"))}
        return data  # (a malformed value is reported by the field's own check)

    @model_validator(mode="after")
    def _task_source(self) -> TrainConfig:
        d = self.data
        if self.env is None:
            if (d.eval is not None or d.eval_fraction) and d.train is None:
                raise ValueError("data.eval / data.eval_fraction: need data.train")
            return self
        kind = self.env.kind
        for key, field in (("task", "task"), ("task_args", "task_args"), ("agent", "agent")):
            if getattr(self, field) != type(self).model_fields[field].get_default(call_default_factory=True):
                raise ValueError(f"{key}: not with env.{kind} (the environment is the task source "
                                 "and plays the rollouts)")
        if self.warm_start.steps:
            raise ValueError(f"warm_start.steps: not with env.{kind} (an environment makes no "
                             "warm-start transcripts)")
        if kind in ("reasoning_gym", "verifiers") and (d.train is not None or d.eval is not None):
            raise ValueError(f"data.train / data.eval: env.{kind} brings its own rows")
        if kind == "environment_class" and d.train is None:
            raise ValueError("data.train: env.environment_class needs the dataset whose rows "
                             "go to reset(**row)")
        if kind == "openenv" and (d.train is None) == (self.env.openenv.size is None):
            raise ValueError("env.openenv.size: " + (
                "not with data.train (its rows are the tasks)" if d.train is not None else
                "give it (rows {'seed': seed + i}) or data.train (rows handed to reset)"))
        return self

    @model_validator(mode="after")
    def _embedded_only(self) -> TrainConfig:
        if self.plugins and self.backend != "embedded":
            raise ValueError("plugins: for backend 'embedded' (verl's workers would not import "
                             "them: the names they register would be unknown there)")
        if self.trainer.precision != "fp32" and self.backend != "embedded":
            raise ValueError(f"trainer.precision: {self.trainer.precision!r} is for backend 'embedded' "
                             "(verl's workers take their precision from the verl section)")
        if self.correction != CorrectionConfig() and self.backend != "embedded":
            raise ValueError("correction: for backend 'embedded' (verl has its own rollout "
                             "correction, set in the verl section)")
        if self.trainer.collect == "continuous":
            if self.backend != "embedded":
                raise ValueError("trainer.collect: 'continuous' is for backend 'embedded'")
            if self.rollout.agent_workers:
                raise ValueError("rollout.agent_workers: not with trainer.collect 'continuous' yet "
                                 "(a worker process plays one group's agents at a time, so a slow "
                                 "group would hold the others back); set it to 0")
        if self.trainer.collect == "overlap":
            if self.backend != "embedded":
                raise ValueError("trainer.collect: 'overlap' is for backend 'embedded'")
            if self.trainer.max_staleness < 1:
                raise ValueError("trainer.max_staleness: must be >= 1 with trainer.collect 'overlap' "
                                 "(it trains on rollouts one version old)")
        return self

    def _not_reproducible(self) -> str | None:
        """Why this run cannot be reproducible (trainer.reproducible), or None."""
        if self.backend != "embedded" or self.engine.kind != "local":
            return (f"backend {self.backend!r}" if self.backend != "embedded"
                    else f"engine.kind {self.engine.kind!r}") + " (its server forms its own batches)"
        if self.runner == "ray":
            return "runner 'ray' (its agents are not counted)"
        if self.trainer.collect == "continuous":
            return "trainer.collect 'continuous' (the trainer's clock decides which groups a step trains)"
        if self.trainer.precision == "auto":
            return "trainer.precision 'auto' (it chooses by timing a pass each way)"
        return None

    @property
    def adapter_policies(self) -> dict[str, LoraConfig]:
        """Several policies: {policy: its adapter} of those that are adapters on `model`."""
        return {n: pc.lora for n, pc in (self.policies or {}).items() if pc.lora is not None}

    @property
    def whole_policies(self) -> list[str]:
        """Several policies: those that are whole models of their own (PolicyConfig.whole)."""
        return [n for n, pc in (self.policies or {}).items() if pc.whole]

    @property
    def role_policies(self) -> dict[str, str]:
        """Several policies: role -> the policy (adapter) that makes its calls; {} without."""
        return {role: name for name, pc in (self.policies or {}).items() for role in pc.roles}

    @property
    def other_policies_roles(self) -> list[str]:
        """Several policies, one policy's config (for_policy): the other policies' roles, whose
        turn rewards are not this policy's credit; [] for a run of one policy."""
        train = self.roles.train
        return [role for role in self.role_policies if train is not None and role not in train]

    def for_policy(self, name: str) -> TrainConfig:
        """The run as policy `name` learns it (run/policies.py): roles.train its roles that train
        (all of them when roles.train is null), its optimizer settings and KL coefficient where it
        sets them (`optim` and `loss.kl_coef` otherwise). Not validated again (a copy)."""
        pc = self.policies[name]
        train = [role for role in pc.roles if self.roles.train is None or role in self.roles.train]
        optim = {k: getattr(pc, k) for k in ("lr", "warmup_steps", "decay", "weight_decay", "grad_clip")
                 if getattr(pc, k) is not None}
        loss = {} if pc.kl_coef is None else {"kl_coef": pc.kl_coef}
        return self.model_copy(update={"roles": self.roles.model_copy(update={"train": train}),
                                       "optim": self.optim.model_copy(update=optim),
                                       "loss": self.loss.model_copy(update=loss)})

    @property
    def lockstep(self) -> bool:
        """Whether the engine's batches close in lockstep (trainer.reproducible)."""
        return self.trainer.reproducible is not False and self._not_reproducible() is None

    @model_validator(mode="after")
    def _reproducible(self) -> TrainConfig:
        why = self._not_reproducible()
        if self.trainer.reproducible and why:
            raise ValueError(f"trainer.reproducible: true is not possible with {why}; leave it "
                             "null (on where it applies) or set it false")
        return self

    @model_validator(mode="after")
    def _engine(self) -> TrainConfig:
        if self.engine.kind != "local" and self.backend != "embedded":
            raise ValueError("engine.kind: for backend 'embedded' (verl's rollout engine is "
                             "configured in the verl section)")
        if getattr(self.engine, "sleep_level", 0) and self.trainer.collect != "step":
            raise ValueError("engine.sleep_level: the server cannot sleep during the update while "
                             f"trainer.collect {self.trainer.collect!r} collects beside it")
        frozen = sorted(r for r, e in self.roles.serve.items() if e == "frozen")
        if frozen and (self.engine.kind != "local" or self.backend != "embedded"):
            raise ValueError(f"roles.serve: 'frozen' ({frozen}) is a copy of the policy in a local "
                             "engine: for engine.kind local on the embedded backend")
        return self

    @model_validator(mode="after")
    def _lora(self) -> TrainConfig:
        if self.model.lora is None and self.policies is None:
            return self
        key = "model.lora" if self.model.lora is not None else "policies"
        ranks = [self.model.lora.r] if self.model.lora is not None else [
            lc.r for lc in self.adapter_policies.values()]
        if not ranks:  # every policy a whole model: _policies refuses what they cannot run with
            return self
        if self.backend != "embedded":
            raise ValueError(f"{key}: not with backend {self.backend!r} yet (LoRA runs on the "
                             "embedded backend)")
        if self.engine.kind == "local" and self.trainer.collect == "continuous" and self.trainer.max_staleness:
            raise ValueError(f"{key}: not with trainer.collect 'continuous' (max_staleness >= 1) "
                             "and engine.kind 'local' (the engine's own copy of the policy would copy "
                             "the base weights too); with engine.kind 'vllm' it runs")
        if self.engine.kind == "local" and self.trainer.collect == "overlap":
            raise ValueError(f"{key}: not with trainer.collect 'overlap' and engine.kind 'local' "
                             "(the engine's own copy of the policy would copy the base weights too); "
                             "with engine.kind 'vllm' it runs")
        if self.engine.kind == "vllm":  # the adapter alone is synced, by vLLM's runtime LoRA loading
            refused = {"engine.base_url": (self.engine.base_url is not None and self.engine.base_url,
                                           "tracetrain launches the server with LoRA enabled: use "
                                           "engine.python"),
                       "engine.sync": (self.engine.sync != "disk" and self.engine.sync,
                                       "the adapter goes to the server by disk"),
                       "engine.sleep_level": (self.engine.sleep_level == 2 and 2,
                                              "level 2 drops the server's base weights and a LoRA "
                                              "sync brings only the adapter; use 1")}
            for field, (value, why) in refused.items():
                if value:
                    raise ValueError(f"{key}: not with {field} {value!r} ({why})")
            if max(ranks) > 512:
                raise ValueError(f"{key}{'.r' if key == 'model.lora' else ''}: at most 512 with "
                                 "engine.kind 'vllm' (vLLM's largest --max-lora-rank)")
        return self

    @model_validator(mode="after")
    def _policies(self) -> TrainConfig:
        if self.policies is None:
            return self
        if not self.policies:
            raise ValueError("policies: name at least one policy, or leave it null")
        owner: dict[str, str] = {}
        for name, pc in self.policies.items():
            if name in RESERVED_POLICY_NAMES or name in "lora_" or not POLICY_NAME.fullmatch(name):
                raise ValueError(f"policies.{name}: not a policy name (letters, digits, _ and -, "
                                 "starting with a letter or digit, at most 64; not '__base__' nor "
                                 "part of 'lora_')")
            for role in pc.roles:
                if role in owner:
                    raise ValueError(f"policies.{name}.roles: role {role!r} is already policy "
                                     f"{owner[role]!r}'s (a role belongs to one policy)")
                owner[role] = name
        unmapped = sorted(set(self.roles.train or ()) - set(owner))
        if unmapped:
            raise ValueError(f"roles.train: {unmapped} belong to no policy (policies.*.roles): "
                             "with several policies each trained role is a policy's")
        elsewhere = sorted(r for r, e in self.roles.serve.items() if e != "policy" and r in owner)
        if elsewhere:
            raise ValueError(f"roles.serve: {elsewhere} are policies' roles (policies.*.roles) and "
                             "are served by their policy's adapter")
        if self.model.lora is not None:
            raise ValueError("model.lora: not with policies (each policy is its own adapter: "
                             "policies.<name>.lora)")
        why = (f"backend {self.backend!r}" if self.backend != "embedded" else None) or (
            f"engine.kind {self.engine.kind!r}" if self.engine.kind not in ("local", "vllm") else None) or (
            None)
        if why:
            raise ValueError(f"policies: not with {why} yet (several policies run as adapters on "
                             "the local or vllm engine of the embedded backend)")
        for name, pc in self.policies.items():
            if pc.model is not None and pc.lora is not None:
                raise ValueError(f"policies.{name}.lora: an adapter on a policy's own model is not "
                                 "built (leave lora out: the policy's model trains whole)")
            if pc.model is not None and pc.model.lora is not None:
                raise ValueError(f"policies.{name}.model.lora: a policy's own model trains whole "
                                 "(no adapter)")
        for name in self.whole_policies:
            ahead = self.trainer.collect == "overlap" or (
                self.trainer.collect == "continuous" and self.trainer.max_staleness > 0)
            why = (f"engine.kind {self.engine.kind!r}" if self.engine.kind != "local" else None) or (
                f"trainer.collect {self.trainer.collect!r} ahead of the update (max_staleness "
                f"{self.trainer.max_staleness})" if ahead else None)
            if why:
                raise ValueError(f"policies.{name}: a whole model of its own not with {why} yet "
                                 "(it has a local engine of its own, given its weights in place)")
        return self

    @model_validator(mode="after")
    def _gateway_url(self) -> TrainConfig:
        if self.gateway.host in WILDCARD_HOSTS and self.gateway.public_url is None:
            raise ValueError(f"gateway.public_url: required when gateway.host is {self.gateway.host!r} "
                             "(a wildcard address is no URL an agent can reach)")
        return self

    @model_validator(mode="after")
    def _norm_length(self) -> TrainConfig:
        if self.loss.mode == "seq-mean-token-sum-norm" and self.loss.norm_length is None:
            raise ValueError("loss.norm_length: required when loss.mode is 'seq-mean-token-sum-norm'")
        return self


