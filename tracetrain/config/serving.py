"""What serves the agents' calls: the gateway, the engine (one model per kind, chosen by
`engine.kind`), and verl's section for backend `verl`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from tracetrain.config.base import _Section, registered

WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # every interface: an address to bind, not one to reach


class GatewayConfig(_Section):
    """Where the trainer's gateway listens and the URL its agents are given. The default keeps it
    on loopback. For agents on other hosts (Ray workers, sandboxes): `host` an interface address
    or a wildcard (0.0.0.0, ::), `public_url` the base URL they reach it at (a TLS proxy in front
    of it, say); `{port}` in it stands for the bound port. Off loopback the admin key must come
    from $TRACETRAIN_ADMIN_KEY; agents always need their rollout's own key. `context`: how chat
    prompts are built, `exact` (the earlier turn's ids + the new messages) or `template` (the chat
    template's full render); docs/gateway.md. `tool_parser`: the format of the model's tool calls
    (auto: detected from the chat template), and whether tools are written into the prompt of a
    template that drops them."""

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
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral", "off"] = "auto"
    """The format of the model's tool calls. `auto`: detected from the chat template; where the
    template drops tools (SmolLM2's), the gateway writes them into the system message in the
    Hermes format and reads calls as hermes (docs/gateway.md). `hermes`: the same, calls read as
    hermes. `llama3_json`, `mistral`: that format, never the tool block. `off`: as auto, never the
    tool block."""
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
    """A decode step of llama, qwen2, qwen3, mistral and gemma3_text models runs as one function of
    tensors (engines/decode_graph.py: eagerly, transformers' logits bit for bit without its per-layer
    overhead); `true` compiles it with torch.compile (inductor's CPU backend, gcc), eager where
    that fails: a faster step, for a compile at the first batch (short once inductor's disk cache
    has it), and logprobs that differ from eager's by rounding (figures: docs/benchmarks.md, "A
    decode step as one function, and compiled")."""


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
