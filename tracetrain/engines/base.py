"""The engine contract: generate a response for exact prompt token ids, with token ids and logprobs.

The gateway renders chat messages to ids (with the engine's tokenizer and chat template), calls
`generate`, and records the turn. Engines: `local` (transformers in this process) and `upstream`
(an OpenAI-compatible server such as vLLM/SGLang asked for token ids and logprobs).

Constrained decoding: an engine whose `constrains` attribute is True (an upstream vLLM) honours
`SamplingParams.structured`, a vLLM `structured_outputs` object (one of STRUCTURED_KINDS); the
others (the local engine, SGLang; an engine without the attribute) refuse params that carry one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Called with the new response ids, in order, as an engine makes them (in the event loop's thread).
OnTokens = Callable[[list[int]], None]


class EngineError(RuntimeError):
    """The engine failed (not the client's fault). `status` is the HTTP status the gateway answers."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


class PromptTooLong(ValueError):
    """The prompt plus max_tokens does not fit the engine's context: a client error (400)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    # Nucleus sampling: draw from the most likely tokens whose mass before each is < top_p,
    # renormalised (engines/sampling.py); 1: the whole distribution.
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # generation also ends at the tokenizer's eos
    seed: int | None = None
    # Stop strings: generation ends after the token whose text completes one (the tokens are kept
    # in the response; the gateway leaves the string out of the text it answers).
    stop: tuple[str, ...] = ()
    # Constrained decoding: vLLM's `structured_outputs` object, sent as is (engines that constrain
    # only): {"json": schema}, {"json_object": True} or {"structural_tag": "<JSON text>"}.
    structured: dict[str, Any] | None = None
    # Several policies (config `policies`): the LoRA adapter that decodes, a policy's name or
    # "__base__" (the base model alone), for engines that serve adapters; None: the engine's model.
    adapter: str | None = None
    # The chat request's (messages, tools) as the client sent them, for an engine that answers the
    # conversation rather than the prompt ids (`answers_chat = True`: engines/expert.py); None else.
    conversation: tuple[list[dict], list | None] | None = None


# vLLM's structured_outputs constraints (StructuredOutputsParams); an object holds exactly one.
STRUCTURED_KINDS = ("json", "json_object", "structural_tag", "regex", "choice", "grammar")


def can_constrain(engine: Any) -> bool:
    """Whether the engine can constrain decoding (honours SamplingParams.structured)."""
    return getattr(engine, "constrains", False) is True


def check_sampling_params(params: SamplingParams, *, constrains: bool = False,
                          adapters: tuple[str, ...] = ()) -> None:
    """ValueError naming the field when params are out of range (engines call it; nothing is
    clamped), carry a `structured` constraint that an engine which cannot constrain
    (`constrains` False) would ignore, or name an adapter not among the engine's `adapters`."""
    mt, t, p, seed = params.max_tokens, params.temperature, params.top_p, params.seed
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {mt!r}")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    for k, i in enumerate(params.stop_token_ids):
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"stop_token_ids[{k}] must be a token id (int >= 0), got {i!r}")
    for k, text in enumerate(params.stop):
        if not isinstance(text, str) or not text:
            raise ValueError(f"stop[{k}] must be a non-empty string, got {text!r}")
    _check_structured(params.structured, constrains)
    if params.adapter is not None and params.adapter not in adapters:
        raise ValueError(f"adapter {params.adapter!r}: this engine serves "
                         + (f"the adapters {list(adapters)}" if adapters else "no adapter"))


def _check_structured(structured: Any, constrains: bool) -> None:
    if structured is None:
        return
    if not constrains:
        raise ValueError(
            "structured is set, but this engine cannot constrain decoding (an upstream vLLM can)"
        )
    kinds = [k for k in STRUCTURED_KINDS if k in structured] if isinstance(structured, dict) else []
    if len(kinds) != 1:
        raise ValueError(
            f"structured must be a dict holding exactly one of {', '.join(STRUCTURED_KINDS)}, "
            f"got {sorted(structured) if isinstance(structured, dict) else structured!r}"
        )


def stop_string_in(tokenizer: Any, ids: list[int], stop: tuple[str, ...]) -> bool:
    """Whether the text of the last tokens of `ids` holds one of the stop strings (checked after
    each new token, so a string is found when its last token arrives)."""
    window = ids[-(4 * max(map(len, stop)) + 4) :]
    text = tokenizer.decode(window, skip_special_tokens=False)
    return any(s in text for s in stop)


@dataclass(frozen=True)
class Generation:
    response_ids: list[int]
    # log-prob of each response id: the local engine's is log_softmax(logits / T)[id], before
    # top-p (what the trainer computes); an upstream server's is its own kind (vLLM started by
    # tracetrain: after temperature and top-p, renormalised over the nucleus; engines/sampling.py)
    response_logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    model_version: int
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    name: str
    tokenizer: Any  # a transformers tokenizer with a chat template
    model_version: int
    max_context: int  # prompt tokens + max_tokens must fit
    # optional `constrains: bool` (False when absent): honours SamplingParams.structured

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_tokens: OnTokens | None = None
    ) -> Generation:
        """The turn for exact prompt ids. `on_tokens` (streaming): called, in the event loop's
        thread, with each run of new response ids as they are made, so that the runs so far are
        always a prefix of `response_ids`; an engine that cannot stream never calls it (the
        Generation stays the whole truth). Cancelling the call stops decoding for it."""
        ...

    async def aclose(self) -> None: ...
