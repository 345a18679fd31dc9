"""What the store holds and returns: its errors, its records, and the BLOB encoding of token ids
and logprobs (little-endian int32 / float32, 4 bytes per token)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tracetrain.types import DEFAULT_ROLE, RolloutState, ToolStats, Turn

# --------------------------------------------------------------------------------------- errors


class StoreError(Exception):
    """A write the store refused; the message says why. Subclasses map to HTTP statuses."""


class StoreNotReady(StoreError):
    """A store file with nothing in it yet (its writer is creating it)."""


class UnknownRollout(StoreError):
    """No rollout with this id (404)."""


class IllegalTransition(StoreError):
    """A state change not in LEGAL_TRANSITIONS (409)."""


class RolloutEnded(StoreError):
    """A turn or agent event for a rollout already in a terminal state (409)."""


class RolloutConflict(StoreError):
    """Create with an existing id but a different group, task or engine (409)."""


class UnknownTurn(StoreError):
    """A turn reward for a turn the rollout does not have (422, naming the field `turn`)."""


# -------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class NewRollout:
    """What `create_rollouts` needs; `key_salt`/`key_hash` come from the gateway's keys module."""

    rollout_id: str
    group_id: str
    task: Any = None
    engine: str | None = None
    key_salt: bytes = b""
    key_hash: bytes = b""


@dataclass(frozen=True)
class NewTurn:
    """One model call for `Store.add_turn` to record; fields are named as `TurnRecord` names them.

    prompt_ids, response_ids: the token ids the policy saw and produced, stored as int32 and read
        back whole. response_logprobs: one per response id, stored as float32; None: the engine
        gave none. model_version, finish_reason: stored as given.
    context, context_reason, reused_tokens: how the prompt was built (exact | rendered, None for
        a raw prompt; why it was rendered in full, types.REASONS; how many leading prompt ids
        were taken as they were from the earlier turn), stored as given.
    prompt_from: an earlier turn of the same rollout whose prompt + response ids are
        prompt_ids[:reused_tokens] (an exact context). The store checks that turn exists and
        holds exactly reused_tokens ids, no more than prompt_ids has (ValueError otherwise, and
        nothing is written), then may keep only the prompt ids after them; reads return the
        whole prompt either way.
    role: the agent that made the call (checked by the caller: types.check_role).
    messages: JSON of the chat messages the call was sent after those of `prompt_from` (all of
        them without it); bytes are decoded as UTF-8; None: none kept.
    tools: what the answer did with the tools it was offered (types.ToolStats: calls parsed, parse
        failures, calls of unknown tools), stored as three columns; None (NULL): no tools were
        offered, or calls were not parsed.
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    response_logprobs: Sequence[float] | None
    model_version: int | None
    finish_reason: str | None
    context: str | None = None
    context_reason: str | None = None
    reused_tokens: int = 0
    prompt_from: int | None = None
    role: str = DEFAULT_ROLE
    messages: str | bytes | None = None
    tools: ToolStats | None = None


@dataclass(frozen=True)
class RolloutRecord:
    rollout_id: str
    group_id: str
    task: Any
    engine: str | None
    state: RolloutState
    error: str | None
    reward: float | None  # reward_override if set, else the last reward event's value
    reward_override: float | None
    n_turns: int
    created_at: float
    updated_at: float
    seq: int  # insertion order; the paging cursor
    key_salt: bytes = field(repr=False, default=b"")
    key_hash: bytes = field(repr=False, default=b"")


@dataclass(frozen=True)
class RolloutHead:
    """What a model call needs to know about its rollout: cheap to read (no task JSON)."""

    rollout_id: str
    state: RolloutState
    engine: str | None
    key_hash: bytes = field(repr=False, default=b"")


@dataclass(frozen=True)
class TurnRecord:
    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float] | None
    model_version: int | None
    finish_reason: str | None
    created_at: float
    context: str | None = None  # how the prompt was built: exact | rendered (None: a raw prompt)
    context_reason: str | None = None  # why it was rendered in full (types.REASONS)
    reused_tokens: int = 0  # prompt ids taken as they were from the earlier turn
    role: str = DEFAULT_ROLE  # the agent of the program that made the call
    rewards: tuple[TurnReward, ...] = ()  # given to this turn while the rollout ran, in order
    messages: str | None = None  # JSON: the chat messages it was sent (schema.py, version 5)
    tools: ToolStats | None = None  # tool calls, parse failures, unknown calls (version 6); None:
    # no tools offered

    @property
    def reward(self) -> float | None:
        return turn_reward(self.rewards)

    def to_turn(self) -> Turn:
        return Turn(self.prompt_ids, self.response_ids, self.response_logprobs, self.model_version,
                    self.role, self.reward, self.tools)


def turn_reward(rewards: Sequence[TurnReward]) -> float | None:
    """A turn's reward: the sum of the rewards it was given; None when it was given none."""
    return sum(r.reward for r in rewards) if rewards else None


@dataclass(frozen=True)
class TurnReward:
    """A reward an agent gave to one turn while its rollout ran (`name`: what it is for)."""

    reward_id: int
    rollout_id: str
    turn: int
    reward: float
    name: str | None
    created_at: float


@dataclass(frozen=True)
class EventRecord:
    event_id: int
    rollout_id: str
    kind: str
    payload: Any
    reward: float | None  # set for kind == "reward"
    created_at: float


# --------------------------------------------------------------------------- blob encoding

assert array("i").itemsize == 4 and array("f").itemsize == 4
_BIG_ENDIAN = sys.byteorder == "big"


def ids_to_blob(ids: Sequence[int]) -> bytes:
    """Token ids -> little-endian int32 bytes (4 per id)."""
    a = array("i", ids)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def blob_to_id_array(blob: bytes) -> array:
    """Little-endian int32 bytes -> array('i') (one copy, no Python ints)."""
    a = array("i")
    a.frombytes(blob)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


def blob_to_ids(blob: bytes) -> list[int]:
    return blob_to_id_array(blob).tolist()


def floats_to_blob(xs: Sequence[float]) -> bytes:
    """Floats -> little-endian float32 bytes (4 per value)."""
    a = array("f", xs)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def blob_to_float_array(blob: bytes) -> array:
    """Little-endian float32 bytes -> array('f')."""
    a = array("f")
    a.frombytes(blob)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


def blob_to_floats(blob: bytes) -> list[float]:
    return blob_to_float_array(blob).tolist()
