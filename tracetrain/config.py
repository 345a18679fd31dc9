"""The typed run configuration: a YAML file plus `key.sub=value` overrides.

Unknown keys and bad values are errors that name the key (`ConfigError`), never ignored or coerced.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tracetrain.integrations.verl.config import VerlConfig


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class ModelConfig(_Section):
    """Where the policy comes from: a tiny model built from a config, a local path, or a GGUF file."""

    kind: Literal["tiny", "pretrained", "gguf"] = "tiny"
    path: str | None = None  # pretrained dir, or the dir holding the GGUF file
    gguf_file: str | None = None
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    dtype: Literal["float32", "bfloat16"] = "float32"
    # The attention kernel (transformers' name); None: transformers' default (sdpa). "eager" is
    # the fast one for bf16-mixed training on CPU (sdpa's CPU backward in bf16 is several times slower).
    attn_implementation: Literal["sdpa", "eager"] | None = None

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
    batch_size: int = Field(64, gt=0)
    lr: float = Field(1e-3, gt=0)
    transcripts: str = "warm_start_transcripts"  # the task module's function that makes them


class RolloutConfig(_Section):
    tasks_per_step: int = Field(16, gt=0)
    n_per_task: int = Field(8, gt=0)  # the group size
    concurrency: int = Field(256, gt=0)
    timeout_s: float = Field(60.0, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(16, gt=0)
    agent_workers: int = Field(0, ge=0)  # 0: agents on the trainer's event loop; k: in k processes
    # local engine gathering: a batch closes after a quiet batch_window_ms (the loop awake, no request)
    batch_window_ms: float = Field(2.0, ge=0)


class AggregateConfig(_Section):
    level: Literal["trajectory", "transition"] = "trajectory"
    max_prompt_length: int = Field(512, gt=0)
    max_response_length: int = Field(512, gt=0)
    overlong: Literal["drop_rollout", "truncate"] = "drop_rollout"


class AdvantageConfig(_Section):
    estimator: Literal["grpo", "dr-grpo", "rloo", "reinforce++"] = "grpo"
    failed_rollouts: Literal["exclude", "zero_reward"] = "exclude"
    eps: float = Field(1e-6, gt=0)


class LossConfig(_Section):
    mode: Literal[
        "rollout-mean",
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ] = "rollout-mean"
    norm_length: float | None = Field(None, gt=0)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    dual_clip: float | None = Field(3.0, gt=1)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)


class OptimConfig(_Section):
    lr: float = Field(5e-4, gt=0)
    warmup_steps: int = Field(10, ge=0)
    decay: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    mini_batches: int = Field(1, gt=0)  # optimizer updates per PPO epoch
    ppo_epochs: int = Field(1, gt=0)
    micro_batch_tokens: int = Field(65536, gt=0)


class TrainerConfig(_Section):
    steps: int = Field(100, gt=0)
    seed: int = 0
    max_staleness: int = Field(0, ge=0)
    eval_every: int = Field(0, ge=0)  # 0: no eval pass
    eval_tasks: int = Field(64, gt=0)
    checkpoint_every: int = Field(0, ge=0)  # 0: only at the end
    run_dir: str = "runs/default"
    resume: bool = False
    # where the policy trains (and the local engine decodes): "cpu", "cuda" or "cuda:N"
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    threads: int = Field(0, ge=0)  # torch intra-op threads (engine decode); 0: torch's default
    update_threads: int = Field(0, ge=0)  # torch threads of the update (the warm start: the larger of the two); 0: threads
    # The training forward passes (warm start, update, reference): "bf16-mixed" runs them under
    # torch.autocast(bfloat16) with fp32 weights, optimizer and loss; the engine is not affected.
    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    # Collect step k+1's rollouts while step k's update runs (with the policy before that update:
    # its rollouts are one version old, so max_staleness must be >= 1); the engine keeps its own
    # copy of the weights and takes the new ones between two collects.
    overlap_collect: bool = False
    tensorboard: bool = False
    wandb: bool = False


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
    port: int = Field(0, ge=0, le=65535)  # 0: a free port
    public_url: str | None = Field(None, pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")
    context: Literal["exact", "template"] = "exact"
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"

    @field_validator("public_url")
    @classmethod
    def _only_port_in_braces(cls, url: str | None) -> str | None:
        if url is not None and ("{" in url.replace("{port}", "") or "}" in url.replace("{port}", "")):
            raise ValueError("only '{port}' (the bound port) may stand in braces")
        return url


class EngineConfig(_Section):
    """What generates the rollouts. `local` (default): the trainer's own transformers loop, in this
    process. `vllm`: a vLLM server, either one already running at `base_url` (started with
    VLLM_SERVER_DEV_MODE=1, on this machine's files for `sync: disk`), or one tracetrain launches
    with `python` (the interpreter of the venv that has vLLM, scripts/install-vllm.sh) and `args`
    (extra server arguments), on the initial policy written as a Hugging Face directory; it is
    stopped at the end and its log kept in the run dir. After every update the new weights are
    pushed to it (engines/vllm.py)."""

    kind: Literal["local", "vllm"] = "local"
    base_url: str | None = Field(None, pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")
    python: str | None = Field(None, min_length=1)
    args: list[str] = Field(default_factory=list)
    # environment of a launched server, on top of this process's (e.g. VLLM_CPU_OMP_THREADS_BIND)
    env: dict[str, str] = Field(default_factory=dict)
    # disk: a Hugging Face directory and vLLM's reload_weights (CPU or GPU, the server on this
    # machine); nccl: vLLM's NCCL weight-transfer engine (CUDA GPUs)
    sync: Literal["disk", "nccl"] = "disk"
    # one GPU for vLLM and the trainer: the server sleeps during each update (1: weights to CPU
    # memory, KV cache dropped; 2: both dropped, the sync brings new weights); 0: never (CUDA only)
    sleep_level: Literal[0, 1, 2] = 0
    start_timeout_s: float = Field(600.0, gt=0)  # launch until the server answers /health
    request_timeout_s: float = Field(300.0, gt=0)
    # the server's context (prompt + response tokens); None: aggregate's prompt + response lengths
    max_model_len: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _where(self) -> EngineConfig:
        if self.kind == "local":
            for key in ("base_url", "python"):
                if getattr(self, key) is not None:
                    raise ValueError(f"engine.{key}: only for engine.kind 'vllm'")
            for key in ("args", "env"):
                if getattr(self, key):
                    raise ValueError(f"engine.{key}: only for engine.kind 'vllm'")
        elif (self.base_url is None) == (self.python is None):
            raise ValueError("engine.python: engine.kind 'vllm' needs either engine.base_url (a "
                             "running server) or engine.python (the interpreter tracetrain "
                             "launches vLLM with), not both")
        elif self.sleep_level and self.base_url is not None:
            raise ValueError("engine.sleep_level: for a server tracetrain launches (it adds "
                             "--enable-sleep-mode); start yours with it and use engine.python")
        elif self.base_url is not None and (self.args or self.env):
            key = "args" if self.args else "env"
            raise ValueError(f"engine.{key}: for a server tracetrain launches (engine.python); a "
                             "running server at engine.base_url has its own")
        return self


class TrainConfig(_Section):
    """A whole run. `task` is a task module (a .py path relative to the config file, or a module
    name) with `tasks(n, seed=...)`, the agent function named by `agent`, and optionally the
    warm-start transcripts function named by `warm_start.transcripts`."""

    task: str = "examples/guess/task.py"
    task_args: dict[str, Any] = Field(default_factory=dict)
    agent: str = "agent"  # the task module's agent function (or a command, see runner.load_agent)
    backend: Literal["embedded", "verl"] = "embedded"
    runner: Literal["local", "ray"] = "local"
    model: ModelConfig = Field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    aggregate: AggregateConfig = Field(default_factory=AggregateConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)  # backend: embedded only
    verl: VerlConfig = Field(default_factory=VerlConfig)  # backend: verl only

    @model_validator(mode="after")
    def _embedded_only(self) -> TrainConfig:
        if self.trainer.precision != "fp32" and self.backend != "embedded":
            raise ValueError("trainer.precision: 'bf16-mixed' is for backend 'embedded' "
                             "(verl's workers take their precision from the verl section)")
        if self.trainer.overlap_collect:
            if self.backend != "embedded":
                raise ValueError("trainer.overlap_collect: for backend 'embedded' only")
            if self.trainer.max_staleness < 1:
                raise ValueError("trainer.max_staleness: must be >= 1 with trainer.overlap_collect "
                                 "(it trains on rollouts one version old)")
        return self

    @model_validator(mode="after")
    def _engine(self) -> TrainConfig:
        if self.engine.kind != "local" and self.backend != "embedded":
            raise ValueError("engine.kind: for backend 'embedded' (verl's rollout engine is "
                             "configured in the verl section)")
        if self.engine.sleep_level and self.trainer.overlap_collect:
            raise ValueError("engine.sleep_level: the server cannot sleep during the update while "
                             "trainer.overlap_collect collects beside it")
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


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override {key!r}: empty key part")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {p!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["optim.lr=1e-3", "trainer.steps=5"]` -> nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _set_dotted(tree, key.strip(), _scalar(raw.strip()))
    return tree


def _scalar(raw: str) -> Any:
    """A command-line value: int, then float (YAML 1.1 reads `1e-3` as a string), then YAML."""
    for parse in (int, float):
        try:
            return parse(raw)
        except ValueError:
            pass
    return yaml.safe_load(raw) if raw else ""


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


_KEYED = re.compile(r"^Value error, ([a-z_]+(?:\.[a-z_]+)+): (.*)$", re.S)


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(config)"
        keyed = _KEYED.match(e["msg"])
        if keyed:  # a check across keys ("KEY: why"): the input is a whole section, not shown
            lines.append(f"config key {keyed[1]!r}: {keyed[2]}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"config key {key!r}: unknown key")
        else:
            lines.append(f"config key {key!r}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def build_config(data: dict[str, Any] | None = None, overrides: list[str] | None = None) -> TrainConfig:
    tree = _merge(data or {}, parse_overrides(overrides or []))
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return build_config(data, overrides)
