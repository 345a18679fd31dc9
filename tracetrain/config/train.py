"""The whole run: `TrainConfig`, its sections, and the rules that tie keys of several sections
together."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    model_validator,
)

from tracetrain import registry
from tracetrain.config.base import _Section
from tracetrain.config.distill import DistillConfig
from tracetrain.config.model import LoraConfig, ModelConfig
from tracetrain.config.objective import (
    AdvantageConfig,
    AggregateConfig,
    CorrectionConfig,
    LossConfig,
    OptimConfig,
    RolesConfig,
    RolloutConfig,
)
from tracetrain.config.policies import POLICY_NAME, RESERVED_POLICY_NAMES, PolicyConfig
from tracetrain.config.serving import (
    WILDCARD_HOSTS,
    EngineConfig,
    GatewayConfig,
    LocalEngineConfig,
    VerlConfig,
)
from tracetrain.config.tasks import DataConfig, EnvConfig, check_env_kind
from tracetrain.config.trainer import TrainerConfig, WarmStartConfig


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
    """An environment standard as the task source, chosen by `env.kind`: each kind takes its own
    keys (the table marks the keys of some kinds only; docs/environments.md); null: the task
    module."""
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
    distill: DistillConfig | None = None
    """On-policy distillation: a frozen teacher scores every token the policy samples, and its
    per-token term is credit (docs/objective.md); null: none. Several policies: each names its
    own (`policies.<p>.distill`)."""
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

    @model_validator(mode="before")
    @classmethod
    def _env_kind(cls, data: Any) -> Any:
        """An `env` given without a kind this config knows: an error naming `env.kind`."""
        if isinstance(data, dict):
            check_env_kind(data.get("env"))
        return data

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
                raise ValueError(f"{key}: not with env (kind {kind}: the environment is the "
                                 "task source and plays the rollouts)")
        if self.warm_start.steps and self.warm_start.expert is None:
            raise ValueError(f"warm_start.steps: not with env (kind {kind}: an environment makes "
                             "no warm-start transcripts) unless warm_start.expert gives "
                             "demonstrations")
        if kind in ("reasoning_gym", "verifiers") and (d.train is not None or d.eval is not None):
            raise ValueError(f"data.train / data.eval: env.kind {kind} brings its own rows")
        if kind == "environment_class" and d.train is None:
            raise ValueError("data.train: env.kind environment_class needs the dataset whose "
                             "rows go to reset(**row)")
        if kind == "openenv" and (d.train is None) == (self.env.size is None):
            raise ValueError("env.size: " + (
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
                                       "loss": self.loss.model_copy(update=loss),
                                       "distill": pc.distill})

    @property
    def reproducible(self) -> bool:
        """trainer.reproducible resolved: true where it was asked for or left null and applies
        (the engine's batches then close in lockstep, agents/lockstep.py)."""
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
        if (self.engine.kind == "local" and self.trainer.collect == "continuous"
                and self.trainer.max_staleness):
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
    def _distill(self) -> TrainConfig:
        taught = [("distill", self.distill, self.roles.train)] + [
            (f"policies.{n}.distill", pc.distill, pc.roles) for n, pc in (self.policies or {}).items()]
        if self.distill is not None and self.policies is not None:
            raise ValueError("distill: with policies each policy names its own teacher "
                             "(policies.<name>.distill)")
        for key, dc, trained in taught:
            if dc is None:
                continue
            if self.backend != "embedded":
                raise ValueError(f"{key}: for backend 'embedded' (verl's actor takes no teacher)")
            outside = sorted(set(dc.roles or ()) - set(trained)) if trained is not None else []
            if outside:
                raise ValueError(f"{key}.roles: {outside} do not train here (the roles it can "
                                 f"teach: {sorted(trained)})")
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


