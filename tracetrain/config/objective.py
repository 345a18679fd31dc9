"""From rollouts to an update: how they are collected (`rollout`), cut into rows (`aggregate`),
which roles train (`roles`), their advantages, the loss, its corrections and the optimizer."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from tracetrain.config.base import _Section, registered
from tracetrain.types import check_role


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
