"""The plan of the rows (aggregate's step 1): which turns go in which row, with no token copied.

A chain is a maximal run of turns (of one role: roles.role_orders) in which every prompt starts
with the previous turn's context (prompt + response); a row is one contiguous slice of its chain's
last context. `trajectory` grows a row over the chain (observation + response per turn) until a
break or the response limit; `transition` starts a row at every turn. Breaks of the prefix are
classified here (drift.py); the overlong policy is applied to each row's first turn.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from tracetrain.rows.drift import break_position, classify_break, classify_position, snippet
from tracetrain.rows.roles import role_orders
from tracetrain.types import Rollout, TraceError, joined


@dataclass(slots=True)
class Row:
    """One row: chain coords [lo, lo + n_prompt) are its prompt; the next n_region, its region."""

    chain: int  # index into the rollout's chains
    lo: int  # left-truncated prompt tokens
    n_prompt: int
    n_region: int
    n_trained: int
    keep: int  # kept response tokens of the row's first turn
    turns: list[int]


@dataclass
class Plan:
    """Rows of one rollout, its chains (turn indices of each), and its prefix breaks."""

    chains: list[list[int]] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    breaks: list[tuple[int, str, int, int, str]] = field(default_factory=list)


class _Drop(Exception):
    """This rollout leaves the batch for `cause`."""

    def __init__(self, cause: str):
        self.cause = cause


@dataclass
class Counts:
    truncated_prompt_tokens: int = 0
    truncated_response_tokens: int = 0
    truncated_rows: int = 0
    length_splits: int = 0
    length_split_recomputed: int = 0


@dataclass
class Limits:
    max_prompt: int
    max_response: int
    overlong: str


def _extends(prev, prompt: Sequence[int]) -> bool:
    """Whether `prompt` starts with prev.prompt_ids + prev.response_ids (C-speed slice compares:
    lists look at object identity first, arrays compare their memory)."""
    pp, pr = prev.prompt_ids, prev.response_ids
    lp, lr = len(pp), len(pr)
    if len(prompt) < lp + lr:
        return False
    if not isinstance(prompt, array) == isinstance(pp, array) == isinstance(pr, array):
        prompt, pp, pr = list(prompt), list(pp), list(pr)  # a list never equals an array
    return prompt[lp : lp + lr] == pr and prompt[:lp] == pp


def _start_row(r: Rollout, k: int, chain: int, lim: Limits, counts: Counts) -> Row:
    """A row that starts at turn k, with the overlong policy applied to its prompt and response."""
    t = r.turns[k]
    n_p, n_r = len(t.prompt_ids), len(t.response_ids)
    cut, keep = 0, n_r
    if n_p > lim.max_prompt or n_r > lim.max_response:
        field_, n, limit = (
            ("prompt", n_p, lim.max_prompt)
            if n_p > lim.max_prompt
            else ("response", n_r, lim.max_response)
        )
        if lim.overlong == "drop_rollout":
            raise _Drop(f"overlong_{field_}")
        if lim.overlong == "error":
            raise TraceError(
                f"rollout {r.rollout_id!r}, turn {k}: {field_}_ids has {n} tokens, over "
                f"max_{field_}_length={limit} (overlong='error')"
            )
        cut, keep = max(0, n_p - lim.max_prompt), min(n_r, lim.max_response)
        counts.truncated_prompt_tokens += cut
        counts.truncated_response_tokens += n_r - keep
        counts.truncated_rows += 1
    return Row(chain, cut, n_p - cut, keep, keep, keep, [k])


def plan_rollout(
    r: Rollout,
    level: str,
    lim: Limits,
    counts: Counts,
    tokenizer: Any = None,
    want_records: bool = False,
    order: Sequence[int] | None = None,
    plan: Plan | None = None,
) -> Plan:
    """Chains, rows and breaks of one rollout (Python per turn; no token is copied). `order`: the
    turns to walk (one role's, roles.role_orders), all of them by default; a turn chains to the
    one before it in `order`. `plan`: add to this plan (another role's) instead of a new one."""
    turns = r.turns
    order = range(len(turns)) if order is None else order
    plan = Plan() if plan is None else plan
    carried: list[tuple[int, int]] = []  # response spans inherited by the chain's first prompt
    n_context = 0  # len(prompt + response) of the previous turn
    prev_k = None  # the turn before k in `order`
    for k in order:
        t = turns[k]
        p = t.prompt_ids
        if prev_k is not None and _extends(turns[prev_k], p):
            prev_k = k
            plan.chains[-1].append(k)
            row = plan.rows[-1]
            grow = len(p) - n_context + len(t.response_ids)  # observation + response
            n_context = len(p) + len(t.response_ids)
            if level == "trajectory" and row.n_region + grow <= lim.max_response:
                row.n_region += grow
                row.n_trained += len(t.response_ids)
                row.turns.append(k)
                continue
            row = _start_row(r, k, len(plan.chains) - 1, lim, counts)
            if level == "trajectory":
                counts.length_splits += 1
                counts.length_split_recomputed += row.n_prompt
            plan.rows.append(row)
            continue
        # A new chain: the first turn, or the prefix broke (classified at the trajectory level).
        brk = None
        if prev_k is not None and level == "trajectory":
            prev = turns[prev_k]
            spans = carried + [
                (len(turns[j].prompt_ids), len(turns[j].prompt_ids) + len(turns[j].response_ids))
                for j in plan.chains[-1]
            ]
            context = None
            if tokenizer is None:  # from the ids alone; the context list is not built
                position = break_position(prev.prompt_ids, prev.response_ids, p)
                kind = classify_position(position, spans)
            else:
                context = joined(prev.prompt_ids, prev.response_ids)
                kind, position = classify_break(context, p, spans, tokenizer)
            if want_records:
                context = context if context is not None else joined(prev.prompt_ids, prev.response_ids)
                brk = (kind, position, snippet(context, p, position, tokenizer))
            else:
                brk = (kind, position, "")
            # Tokens before `position` are the same in the new prompt: their spans carry over.
            carried = [(a, min(b, position)) for a, b in spans if a < position]
        plan.chains.append([k])
        prev_k = k
        n_context = len(p) + len(t.response_ids)
        row = _start_row(r, k, len(plan.chains) - 1, lim, counts)
        plan.rows.append(row)
        if brk is not None:
            kind, position, text = brk
            plan.breaks.append((k, kind, position, row.n_prompt, text))
    return plan


def _check_rollout(r: Rollout) -> None:
    """O(1) re-checks of a rollout that may have been changed after its validation."""
    if r.reward is not None and (isinstance(r.reward, bool) or not math.isfinite(r.reward)):
        raise TraceError(f"rollout {r.rollout_id!r}: reward is {r.reward!r}; it must be finite")
    for k, t in enumerate(r.turns):
        lp = t.response_logprobs
        if not t.prompt_ids or (lp is not None and len(lp) != len(t.response_ids)):
            t.validate(r.rollout_id, k)  # raises the precise TraceError


@dataclass
class Planned:
    """The plans of the rollouts kept (rollout indices in batch order) and what was dropped."""

    kept: list[int] = field(default_factory=list)
    rollouts: list[Rollout] = field(default_factory=list)  # rollouts[kept[j]]
    plans: list[Plan] = field(default_factory=list)
    breaks: list[tuple] = field(default_factory=list)  # DriftBreak fields
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("no_turns", "overlong_prompt", "overlong_response", "no_trained_tokens"), 0))
    n_zero_rows: int = 0
    counts: Counts = field(default_factory=Counts)

    @property
    def rows_per_rollout(self) -> list[int]:
        return [len(plan.rows) for plan in self.plans]


def plan_rollouts(rollouts: Sequence[Rollout], level: str, lim: Limits, tokenizer,
                  return_breaks: bool, train_roles: Collection[str] | None = None) -> Planned:
    """Step 1: plan every rollout (chains, rows, breaks), role by role; drop rollouts with no
    turns, over the limits (drop_rollout) or with no trained token, and rows with no trained
    token."""
    out = Planned()
    for ri, r in enumerate(rollouts):
        _check_rollout(r)
        if not r.turns:
            out.dropped["no_turns"] += 1
            continue
        before = Counts(**vars(out.counts))
        try:
            plan = Plan()
            for order in role_orders(r.turns, train_roles):
                plan_rollout(r, level, lim, out.counts, tokenizer, return_breaks, order, plan)
        except _Drop as drop:
            out.dropped[drop.cause] += 1
            out.counts = before  # a dropped rollout leaves no trace in the counts
            continue
        rows = [row for row in plan.rows if row.n_trained > 0]
        out.n_zero_rows += len(plan.rows) - len(rows)
        if not rows:
            out.dropped["no_trained_tokens"] += 1
            continue
        plan.rows = rows
        out.kept.append(ri)
        out.rollouts.append(r)
        out.plans.append(plan)
        out.breaks.extend((r.rollout_id, *b) for b in plan.breaks)
    return out


