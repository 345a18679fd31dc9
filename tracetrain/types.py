"""The data model: a rollout is a list of turns, each turn the exact token ids the policy saw and made.

Validation is strict and nothing is coerced: a bad value raises `TraceError` naming the rollout,
the turn and the field. Checks run once, when a `Turn` or `Rollout` is built; later stages trust them.

Token ids are a `list[int]` or an `array.array` of an integer type code (IDS_TYPECODES);
logprobs a `list[float]` or an `array.array` of 'f'/'d'. The store hands turns out as int32 /
float32 arrays (its columns are those bytes), which stages read without touching a Python int.
A turn's values are kept exactly as given: a list stays the caller's list, an array the array.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

# A log-probability is <= 0; engines in low precision may return a hair above it.
LOGPROB_TOLERANCE = 1e-3


# A turn's context: its prompt continued the turn before it (EXACT) or was the template's full
# render (RENDERED), and why (the gateway records these; gateway/context.py):
EXACT, RENDERED = "exact", "rendered"
# Why a turn's prompt was rendered in full:
TEMPLATE = "template"  # gateway.context: template (every prompt the full render)
FIRST_TURN = "first_turn"  # the first call of its role in the rollout
FORGOTTEN = "forgotten"  # its role's earlier turns exist but the gateway holds none (restart, eviction)
NO_MATCH = "no_match"  # no earlier turn's conversation is a prefix of the messages
TEMPLATE_PREFIX = "template_prefix"  # the template's render of the base is not a prefix
REASONS = (TEMPLATE, FIRST_TURN, FORGOTTEN, NO_MATCH, TEMPLATE_PREFIX)


class UsageError(ValueError):
    """Something the user gave is wrong (an option, a file, a dataset row): the message names it.
    The command line reports it in one line with status 2; any other error keeps its traceback."""


class RunFailed(RuntimeError):
    """A run (or an eval) could not go on because its rollouts failed: the message names the
    step and the first failed rollout's error (run/failures.py). The command line reports it in
    one line with status 1."""


class TraceError(ValueError):
    """Bad input in a trace; the message names the rollout, the turn and the field."""


class RolloutState(str, Enum):
    """Life of a rollout: queued -> running -> succeeded | failed | timed_out (terminal)."""

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    timed_out = "timed_out"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def infra_failure(self) -> bool:
        """States that say nothing about the policy: excluded from training by default."""
        return self in (RolloutState.failed, RolloutState.timed_out)


TERMINAL_STATES = frozenset({RolloutState.succeeded, RolloutState.failed, RolloutState.timed_out})

# queued -> running -> terminal; a terminal state is final.
LEGAL_TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    RolloutState.queued: frozenset({RolloutState.running, RolloutState.failed, RolloutState.timed_out}),
    RolloutState.running: TERMINAL_STATES,
    RolloutState.succeeded: frozenset(),
    RolloutState.failed: frozenset(),
    RolloutState.timed_out: frozenset(),
}


def _where(rollout_id: str | None, turn_index: int | None) -> str:
    parts = []
    if rollout_id is not None:
        parts.append(f"rollout {rollout_id!r}")
    if turn_index is not None:
        parts.append(f"turn {turn_index}")
    return ", ".join(parts) + ": " if parts else ""


IDS_TYPECODES = frozenset("bBhHiIlLqQ")  # array.array type codes of integers
LOGPROB_TYPECODES = frozenset("fd")


def values_of(a: array) -> np.ndarray:
    """A read-only numpy view of an array.array (no copy)."""
    return np.frombuffer(a, dtype=a.typecode)


def joined(a: Sequence, b: Sequence) -> Sequence:
    """a + b: an array when both are arrays of one type code, else a list."""
    if isinstance(a, array) and isinstance(b, array) and a.typecode == b.typecode:
        return a + b
    return (a if isinstance(a, list) else list(a)) + (b if isinstance(b, list) else list(b))


def same_kind(a: Sequence, b: Sequence) -> tuple[Sequence, Sequence]:
    """(a, b) in forms that compare by value with == and slices: a list never equals an array,
    so a list/array pair is compared as two lists (arrays of any type codes compare by value)."""
    if isinstance(a, array) == isinstance(b, array):
        return a, b
    return list(a), list(b)


def _check_id_array(ids: array, name: str, where: str, *, allow_empty: bool) -> array:
    if ids.typecode not in IDS_TYPECODES:
        raise TraceError(f"{where}{name} is an array of type code {ids.typecode!r}; token ids need an "
                         f"integer type code ({''.join(sorted(IDS_TYPECODES))})")
    if not ids:
        if allow_empty:
            return ids
        raise TraceError(f"{where}{name} is empty; a turn needs at least one token id")
    v = values_of(ids)
    lo, hi = int(v.min()), int(v.max())
    if lo < 0:
        raise TraceError(f"{where}{name}[{int(v.argmin())}] is {lo}; token ids must be >= 0")
    if hi >= 2**63:  # rows hold int64
        raise TraceError(f"{where}{name}[{int(v.argmax())}] is {hi}; token ids must be < 2**63")
    return ids


def _check_ids(ids: object, name: str, where: str, *, allow_empty: bool) -> list[int] | array:
    if isinstance(ids, array):
        return _check_id_array(ids, name, where, allow_empty=allow_empty)
    if not isinstance(ids, list):
        raise TraceError(f"{where}{name} must be a list (or array.array) of int token ids, "
                         f"got {type(ids).__name__}")
    if not ids:
        if allow_empty:
            return ids
        raise TraceError(f"{where}{name} is empty; a turn needs at least one token id")
    # bool is an int subclass: a True in a token list is a bug, not token 1.
    if set(map(type, ids)) != {int}:
        i, t = next((i, t) for i, t in enumerate(ids) if type(t) is not int)
        raise TraceError(f"{where}{name}[{i}] is {t!r} ({type(t).__name__}); token ids must be int")
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise TraceError(f"{where}{name}[{ids.index(lo)}] is {lo}; token ids must be >= 0")
    if hi >= 2**63:  # rows hold int64
        raise TraceError(f"{where}{name}[{ids.index(hi)}] is {hi}; token ids must be < 2**63")
    return ids


def _check_finite(x: object, name: str, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TraceError(f"{where}{name} must be a number, got {x!r} ({type(x).__name__})")
    if not math.isfinite(x):
        raise TraceError(f"{where}{name} is {x!r}; it must be finite")
    return x


def _check_logprob_array(lp: array, where: str) -> None:
    if lp.typecode not in LOGPROB_TYPECODES:
        raise TraceError(f"{where}response_logprobs is an array of type code {lp.typecode!r}; "
                         "logprobs need 'f' or 'd'")
    v = values_of(lp)
    bad = ~np.isfinite(v) | (v > LOGPROB_TOLERANCE)
    if bad.any():
        j = int(bad.argmax())
        why = "it must be a finite float" if not math.isfinite(v[j]) else "a log-probability is <= 0"
        raise TraceError(f"{where}response_logprobs[{j}] is {float(v[j])!r}; {why}")


# A role's name: what a harness sends as the request's `model` ("solver", "gpt-4o-mini",
# "Qwen/Qwen2.5-7B-Instruct"), or names in the path. Letters, digits and _ . : / -, from a letter or
# digit, at most 100: any model name a framework sends by default, and nothing that is markup.
ROLE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,99}")
DEFAULT_ROLE = "policy"  # the role of a call that names none (the runner's client["model"])


def check_role(role: object, where: str = "") -> str:
    """`role` itself if it is a role name (ROLE_PATTERN), else TraceError naming it."""
    if not isinstance(role, str) or not ROLE_PATTERN.fullmatch(role):
        raise TraceError(
            f"{where}role {role!r} is not a role name: letters, digits and _ . : / - (starting "
            "with a letter or digit), at most 100 characters"
        )
    return role


# The name under which an agent reports its rollout's tool errors in the rollout's `metrics`
# event: calls its harness answered with an error (a tool that raised, a tool that does not exist).
TOOL_ERRORS = "tool_errors"


@dataclass(frozen=True)
class ToolStats:
    """What one turn's answer did with the tools it was offered (the gateway counts it when tools
    were offered and calls parsed: gateway/tool_calls.py `tool_stats`).

    calls           tool calls parsed out of the answer
    parse_failures  calls the answer began that did not parse (the parser's `opened` - calls, >= 0)
    unknown         parsed calls whose name is none of the offered tools' names
    """

    calls: int = 0
    parse_failures: int = 0
    unknown: int = 0

    def check(self, where: str = "") -> None:
        for name in ("calls", "parse_failures", "unknown"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise TraceError(f"{where}tools.{name} is {v!r}; it must be an int >= 0")


@dataclass
class Turn:
    """One model call: the prompt ids the policy saw, the response ids it produced.

    `response_logprobs[j]` is the sampling log-probability of `response_ids[j]`; None when the
    engine did not return them. `model_version` is the policy version that produced the response.
    `role` names the agent of the program that made the call (DEFAULT_ROLE when it named none);
    `reward` is the sum of the rewards given to this turn while the rollout ran (None: none);
    `tools`: what its answer did with the tools offered (None: none were offered, or calls were
    not parsed). Ids are lists or integer `array.array`s, logprobs lists or 'f'/'d' arrays
    (module docstring).
    """

    prompt_ids: list[int] | array
    response_ids: list[int] | array
    response_logprobs: list[float] | array | None = None
    model_version: int | None = None
    role: str = DEFAULT_ROLE
    reward: float | None = None
    tools: ToolStats | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, rollout_id: str | None = None, turn_index: int | None = None) -> None:
        where = _where(rollout_id, turn_index)
        _check_ids(self.prompt_ids, "prompt_ids", where, allow_empty=False)
        check_generation(self.response_ids, self.response_logprobs, self.model_version, where)
        check_role(self.role, where)
        if self.reward is not None:
            _check_finite(self.reward, "reward", where)
        if self.tools is not None:
            if not isinstance(self.tools, ToolStats):
                raise TraceError(f"{where}tools must be a ToolStats or None, got "
                                 f"{type(self.tools).__name__}")
            self.tools.check(where)


def check_generation(
    response_ids: object, response_logprobs: object, model_version: object, where: str = ""
) -> None:
    """The checks a Turn runs on what the engine produced (response ids, logprobs, version)."""
    _check_ids(response_ids, "response_ids", where, allow_empty=False)
    lp = response_logprobs
    if lp is not None:
        if not isinstance(lp, (list, array)):
            raise TraceError(f"{where}response_logprobs must be a list (or array.array) of float "
                             f"or None, got {type(lp).__name__}")
        if len(lp) != len(response_ids):
            raise TraceError(
                f"{where}response_logprobs has {len(lp)} values but response_ids has "
                f"{len(response_ids)} tokens; they must match one to one"
            )
        if isinstance(lp, array):
            _check_logprob_array(lp, where)
        elif (not set(map(type, lp)) <= {float, int} or not all(map(math.isfinite, lp))
              or max(lp) > LOGPROB_TOLERANCE):
            for j, v in enumerate(lp):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise TraceError(f"{where}response_logprobs[{j}] is {v!r}; it must be a finite float")
                if v > LOGPROB_TOLERANCE:
                    raise TraceError(f"{where}response_logprobs[{j}] is {v!r}; a log-probability is <= 0")
    mv = model_version
    if mv is not None and (type(mv) is not int or mv < 0):
        raise TraceError(f"{where}model_version is {mv!r}; it must be an int >= 0 or None")


@dataclass
class Rollout:
    """One run of the agent on one task. `reward` is None until the environment scores it."""

    rollout_id: str
    group_id: str
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    state: RolloutState | str = RolloutState.succeeded

    def __post_init__(self) -> None:
        if not isinstance(self.rollout_id, str) or not self.rollout_id:
            raise TraceError(f"rollout_id must be a non-empty str, got {self.rollout_id!r}")
        where = _where(self.rollout_id, None)
        if not isinstance(self.group_id, str) or not self.group_id:
            raise TraceError(f"{where}group_id must be a non-empty str, got {self.group_id!r}")
        try:
            self.state = RolloutState(self.state)
        except ValueError:
            known = ", ".join(s.value for s in RolloutState)
            raise TraceError(f"{where}state {self.state!r} is unknown; known states: {known}") from None
        if self.reward is not None:
            _check_finite(self.reward, "reward", where)
        if not isinstance(self.turns, list):
            raise TraceError(f"{where}turns must be a list of Turn, got {type(self.turns).__name__}")
        for k, turn in enumerate(self.turns):
            if not isinstance(turn, Turn):
                raise TraceError(f"{where}turns[{k}] is a {type(turn).__name__}, not a Turn")
            turn.validate(self.rollout_id, k)


def check_unique_ids(rollouts: Iterable[Rollout]) -> None:
    """Raise if two rollouts in one batch share a rollout_id."""
    seen: set[str] = set()
    for r in rollouts:
        if r.rollout_id in seen:
            raise TraceError(f"rollout {r.rollout_id!r}: rollout_id appears more than once in the batch")
        seen.add(r.rollout_id)


def check_rollouts(rollouts: Sequence[Rollout]) -> None:
    """Batch-level checks: every item is a Rollout, and rollout ids are unique."""
    for k, r in enumerate(rollouts):
        if not isinstance(r, Rollout):
            raise TraceError(f"rollouts[{k}] is a {type(r).__name__}, not a Rollout")
    check_unique_ids(rollouts)
