"""aggregate: the turns of finished rollouts -> training rows (`TrainingBatch`) + metrics.

Levels (LEVELS):

    transition : one row per turn; row = (prompt_k | response_k).
    trajectory : turn k joins the open row when prompt_k starts with the running context
                 c = prompt_{k-1} + response_{k-1}; the row's response region grows by
                 obs_k = prompt_k[len(c):] (mask 0) and response_k (mask 1). Otherwise the row is
                 closed, the break is classified (drift.py), and a new row starts at turn k.
                 A turn whose obs + response would push the region past max_response_length also
                 starts a new row (a length split, counted; not drift).

Limits: a row whose prompt is over `max_prompt_length`, or a turn whose response is over
`max_response_length`, is handled by the `overlong` policy (OVERLONG_POLICIES):

    drop_rollout (default): the whole rollout leaves the batch; counted per cause.
    truncate: the prompt keeps its last max_prompt_length tokens (the most recent context), the
              response its first max_response_length tokens (with their logprobs); truncated
              tokens are counted.
    error   : raise TraceError naming rollout, turn and field.

Recomputed tokens of a break (and of a length split) = the prompt tokens of the new row, as placed
in the batch: all of them are forwarded again as context with no gradient because the row was
closed (a continued row would only have added the new observation tokens). The break record's
`position` (common prefix of old context and new prompt) is the part that was identical.

Returns (batch, metrics), or (batch, metrics, breaks: list[DriftBreak]) with return_breaks=True.
metrics is a flat dict of numbers (ready for a logger); keys are listed in `aggregate`.

How it is fast. A chain is a maximal run of turns of one rollout in which every prompt starts
with the previous context; every turn's context (prompt + response) is then a prefix of the
chain's last context, and every row, at either level, is one contiguous slice [lo, hi) of it.
So each chain's last context is converted to int64 once (numpy), all chains go into one flat
buffer with P zeros before and R zeros after, and the padded [rows, P+R] tensors are gathered
with a row index from a sliding-window view of that buffer (`as_strided` + `index_select`).
The trained-token mask uses the same windows over a chain-long mask; the logprobs of the rows'
turns, in row order, are exactly the trained tokens in row-major order (`masked_scatter_`).
No per-token Python work, no per-row torch op, no index tensor larger than one int64 per row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain as chained
from itertools import repeat
from typing import Any

import numpy as np
import torch

from tracetrain.batch import TrainingBatch
from tracetrain.drift import DRIFT_KINDS, DriftBreak, classify_break, snippet
from tracetrain.types import LOGPROB_TOLERANCE, Rollout, RolloutState, TraceError, check_rollouts

LEVELS = ("transition", "trajectory")
OVERLONG_POLICIES = ("drop_rollout", "truncate", "error")
LENGTH_SPLIT = "length_split"


@dataclass
class _Row:
    """One row: chain coordinates [lo, lo + n_prompt) are its prompt, the next n_region its region."""

    chain: int  # index into the rollout's chains
    lo: int  # left-truncated prompt tokens
    n_prompt: int
    n_region: int
    n_trained: int
    keep: int  # kept response tokens of the row's first turn
    turns: list[int] = field(default_factory=list)


@dataclass
class _Plan:
    """Rows of one rollout, its chains (turn indices of each), and its prefix breaks."""

    chains: list[list[int]] = field(default_factory=list)
    rows: list[_Row] = field(default_factory=list)
    breaks: list[tuple[int, str, int, int, str]] = field(default_factory=list)


class _Drop(Exception):
    """This rollout leaves the batch for `cause`."""

    def __init__(self, cause: str):
        self.cause = cause


@dataclass
class _Counts:
    truncated_prompt_tokens: int = 0
    truncated_response_tokens: int = 0
    truncated_rows: int = 0
    length_splits: int = 0
    length_split_recomputed: int = 0


@dataclass
class _Limits:
    max_prompt: int
    max_response: int
    overlong: str


def _extends(prev, prompt: list[int]) -> bool:
    """Whether `prompt` starts with prev.prompt_ids + prev.response_ids (C-speed slice compares)."""
    lp, lr = len(prev.prompt_ids), len(prev.response_ids)
    return (
        len(prompt) >= lp + lr
        and prompt[lp : lp + lr] == prev.response_ids
        and prompt[:lp] == prev.prompt_ids
    )


def _start_row(r: Rollout, k: int, chain: int, lim: _Limits, counts: _Counts) -> _Row:
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
    return _Row(chain, cut, n_p - cut, keep, keep, keep, [k])


def plan_rollout(
    r: Rollout,
    level: str,
    lim: _Limits,
    counts: _Counts,
    tokenizer: Any = None,
    want_records: bool = False,
) -> _Plan:
    """Chains, rows and breaks of one rollout (Python per turn; no token is copied)."""
    turns = r.turns
    plan = _Plan()
    carried: list[tuple[int, int]] = []  # response spans inherited by the chain's first prompt
    for k, t in enumerate(turns):
        p = t.prompt_ids
        if k > 0 and _extends(turns[k - 1], p):
            plan.chains[-1].append(k)
            row = plan.rows[-1]
            grow = (
                len(p)
                - len(turns[k - 1].prompt_ids)
                - len(turns[k - 1].response_ids)
                + len(t.response_ids)
            )
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
        # A new chain: turn 0, or the prefix broke (classified at the trajectory level).
        brk = None
        if k > 0 and level == "trajectory":
            prev = turns[k - 1]
            context = prev.prompt_ids + prev.response_ids
            spans = carried + [
                (len(turns[j].prompt_ids), len(turns[j].prompt_ids) + len(turns[j].response_ids))
                for j in plan.chains[-1]
            ]
            kind, position = classify_break(context, p, spans, tokenizer)
            # Tokens before `position` are the same in the new prompt: their spans carry over.
            carried = [(a, min(b, position)) for a, b in spans if a < position]
            brk = (kind, position, snippet(context, p, position, tokenizer) if want_records else "")
        plan.chains.append([k])
        row = _start_row(r, k, len(plan.chains) - 1, lim, counts)
        plan.rows.append(row)
        if brk is not None:
            kind, position, text = brk
            plan.breaks.append((k, kind, position, row.n_prompt, text))
    return plan


def _check_args(level, max_prompt_length, max_response_length, pad_token_id, overlong):
    if level not in LEVELS:
        raise ValueError(f"level {level!r} is unknown; choose one of {LEVELS}")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong {overlong!r} is unknown; choose one of {OVERLONG_POLICIES}")
    for name, v, lo in (
        ("max_prompt_length", max_prompt_length, 1),
        ("max_response_length", max_response_length, 1),
        ("pad_token_id", pad_token_id, 0),
    ):
        if type(v) is not int or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _check_rollout(r: Rollout) -> None:
    """O(1) re-checks of a rollout that may have been changed after its validation."""
    if r.reward is not None and (isinstance(r.reward, bool) or not math.isfinite(r.reward)):
        raise TraceError(f"rollout {r.rollout_id!r}: reward is {r.reward!r}; it must be finite")
    for k, t in enumerate(r.turns):
        lp = t.response_logprobs
        if not t.prompt_ids or (lp is not None and len(lp) != len(t.response_ids)):
            t.validate(r.rollout_id, k)  # raises the precise TraceError


def _find_bad_input(rollouts: Sequence[Rollout]) -> None:
    """Slow path after a cheap vectorized check failed: full validation raises the clear error."""
    for r in rollouts:
        for k, t in enumerate(r.turns):
            t.validate(r.rollout_id, k)
    raise TraceError("bad token id or logprob in the batch, but no turn fails validation")


def _windows(buf: torch.Tensor, start: torch.Tensor, width: int) -> torch.Tensor:
    """[len(start), width] copy of buf[start_i : start_i + width] for every i (no per-cell index)."""
    view = buf.as_strided((buf.numel() - width + 1, width), (1, 1))
    return view.index_select(0, start)


def aggregate(
    rollouts: Sequence[Rollout],
    *,
    level: str = "trajectory",
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int = 0,
    tokenizer: Any = None,
    overlong: str = "drop_rollout",
    pad_to_limits: bool = False,
    return_breaks: bool = False,
):
    """Build the rows of `rollouts` (never modified) and count what happened.

    P, R (prompt/response widths) are the batch maxima, or the limits with pad_to_limits=True.
    position_ids are 0 on the left padding and keep counting over the right padding.
    Per row: model_version = oldest model_version of its turns, -1 if any is unknown;
    rollout_logprobs is None when any kept turn lacks logprobs. Per rollout: reward (NaN if None)
    and state. Rollouts with no turns, and rows with zero trained tokens, are dropped and counted.
    Turn contents are trusted to have passed Turn validation; what is cheap is checked again
    (lengths, negative ids, non-finite or positive logprobs, rewards, duplicate rollout ids).

    metrics: n_rollouts_in, n_rollouts, n_rows, n_multi_row_rollouts, max_rows_per_rollout,
    dropped_rollouts/{no_turns, overlong_prompt, overlong_response, no_trained_tokens},
    dropped_rows/zero_trained_tokens, truncated/{rows, prompt_tokens, response_tokens},
    tokens/{prompt, observation, trained, non_pad, cells}, tokens/trained_fraction (of non_pad);
    trajectory level only: breaks/{total, <kind>}, recomputed_tokens/{<kind>, length_split},
    length_splits.
    """
    _check_args(level, max_prompt_length, max_response_length, pad_token_id, overlong)
    if not isinstance(rollouts, Sequence):
        raise TypeError(f"rollouts must be a sequence of Rollout, got {type(rollouts).__name__}")
    check_rollouts(rollouts)
    lim = _Limits(max_prompt_length, max_response_length, overlong)

    # 1. Plan every rollout: chains, rows, breaks.
    counts = _Counts()
    dropped = dict.fromkeys(
        ("no_turns", "overlong_prompt", "overlong_response", "no_trained_tokens"), 0
    )
    n_zero_rows = 0
    kept: list[int] = []  # rollout indices in batch order
    plans: list[_Plan] = []
    records: list[DriftBreak] = []
    for ri, r in enumerate(rollouts):
        _check_rollout(r)
        if not r.turns:
            dropped["no_turns"] += 1
            continue
        before = _Counts(**vars(counts))
        try:
            plan = plan_rollout(r, level, lim, counts, tokenizer, return_breaks)
        except _Drop as drop:
            dropped[drop.cause] += 1
            counts = before  # a dropped rollout leaves no trace in the counts
            continue
        rows = [row for row in plan.rows if row.n_trained > 0]
        n_zero_rows += len(plan.rows) - len(rows)
        if not rows:
            dropped["no_trained_tokens"] += 1
            continue
        plan.rows = rows
        kept.append(ri)
        plans.append(plan)
        records.extend(DriftBreak(r.rollout_id, k, *rest) for k, *rest in plan.breaks)

    # 2. Per-row numbers and the chains the rows use, in batch order (Python per row / turn).
    rows = [row for plan in plans for row in plan.rows]
    n_rows = len(rows)
    n_prompt = [row.n_prompt for row in rows]
    n_region = [row.n_region for row in rows]
    if pad_to_limits:
        P, R = max_prompt_length, max_response_length
    else:
        P, R = max(n_prompt, default=0), max(n_region, default=0)
    ids_lists: list[list[int]] = []  # per chain: its last turn's prompt ids, response ids
    lp_lists: list[list[float] | None] = []  # per row turn, in row order: the kept logprobs
    run_len, run_trained = [P], [False]  # trained-token runs over the whole buffer
    row_start: list[int] = []  # buffer index of each row's first region token
    row_version: list[int] = []
    offset = P  # the buffer starts with P zeros
    for ri, plan in zip(kept, plans, strict=True):
        turns = rollouts[ri].turns
        chain_start: dict[int, int] = {}
        for row in plan.rows:
            if row.chain not in chain_start:  # emit the chain once, at its first row
                chain_start[row.chain] = offset
                pos = 0
                for j in plan.chains[row.chain]:
                    t = turns[j]
                    run_len += (len(t.prompt_ids) - pos, len(t.response_ids))
                    run_trained += (False, True)
                    pos = len(t.prompt_ids) + len(t.response_ids)
                ids_lists += (turns[j].prompt_ids, turns[j].response_ids)
                offset += pos
            row_start.append(chain_start[row.chain] + row.lo + row.n_prompt)
            lp_first = turns[row.turns[0]].response_logprobs
            lp_lists.append(
                lp_first if lp_first is None or row.keep == len(lp_first) else lp_first[: row.keep]
            )
            lp_lists += (turns[j].response_logprobs for j in row.turns[1:])
            versions = [turns[j].model_version for j in row.turns]
            row_version.append(-1 if None in versions else min(versions))
    n_buf = offset + R  # and R zeros at the end
    run_len.append(R)
    run_trained.append(False)

    # 3. Vectorized layout: left-padded prompt | right-padded response region. Row i is the
    # window of width P+R that starts P columns before its first region token.
    start = torch.tensor(row_start, dtype=torch.int64)
    first = (P - torch.tensor(n_prompt, dtype=torch.int64)).unsqueeze(1)  # first real column
    end = P + torch.tensor(n_region, dtype=torch.int64).unsqueeze(1)  # one past the last
    col = torch.arange(P + R)
    valid = col >= first
    valid &= col < end
    ids_iter = chained(repeat(0, P), chained.from_iterable(ids_lists), repeat(0, R))
    ids_buf = torch.from_numpy(np.fromiter(ids_iter, np.int64, n_buf))
    if n_rows and int(ids_buf.min()) < 0:
        _find_bad_input([rollouts[ri] for ri in kept])
    input_ids = _windows(ids_buf, start - P, P + R)
    del ids_buf  # freed before the next output of the same size is allocated
    input_ids.masked_fill_(valid.logical_not(), pad_token_id)
    attention_mask = valid.to(torch.int64)
    position_ids = (col - first).clamp_(min=0)  # 0 on left pad; keeps counting over right pad

    trained_buf = torch.repeat_interleave(
        torch.tensor(run_trained, dtype=torch.bool), torch.tensor(run_len, dtype=torch.int64)
    )
    response_mask = _windows(trained_buf, start, R)
    response_mask &= valid[:, P:]
    del trained_buf, valid

    rollout_logprobs = None
    if None not in lp_lists:  # trained tokens in row-major order = the row turns' logprobs
        n_lp = sum(row.n_trained for row in rows)
        flat_lp = torch.from_numpy(np.fromiter(chained.from_iterable(lp_lists), np.float32, n_lp))
        if n_lp and (
            not bool(torch.isfinite(flat_lp).all()) or float(flat_lp.max()) > LOGPROB_TOLERANCE
        ):
            _find_bad_input([rollouts[ri] for ri in kept])
        rollout_logprobs = torch.zeros((n_rows, R), dtype=torch.float32)
        rollout_logprobs.masked_scatter_(response_mask, flat_lp)
        del flat_lp

    rows_per_rollout = [len(plan.rows) for plan in plans]
    batch = TrainingBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        rollout_ids=[
            rollouts[ri].rollout_id
            for ri, c in zip(kept, rows_per_rollout, strict=True)
            for _ in range(c)
        ],
        group_ids=[
            rollouts[ri].group_id
            for ri, c in zip(kept, rows_per_rollout, strict=True)
            for _ in range(c)
        ],
        turn_index=torch.tensor([row.turns[0] for row in rows], dtype=torch.int64),
        rollout_index=torch.repeat_interleave(
            torch.arange(len(kept)), torch.tensor(rows_per_rollout, dtype=torch.int64)
        ),
        rollouts=[rollouts[ri].rollout_id for ri in kept],
        rewards=torch.tensor(
            [
                math.nan if rollouts[ri].reward is None else float(rollouts[ri].reward)
                for ri in kept
            ],
            dtype=torch.float32,
        ),
        rollout_states=[RolloutState(rollouts[ri].state).value for ri in kept],
        model_version=torch.tensor(row_version, dtype=torch.int64),
    )

    # 4. Metrics.
    tokens_prompt, tokens_region = sum(n_prompt), sum(n_region)
    tokens_trained = sum(row.n_trained for row in rows)
    metrics: dict[str, float] = {
        "n_rollouts_in": len(rollouts),
        "n_rollouts": len(kept),
        "n_rows": n_rows,
        "n_multi_row_rollouts": sum(c > 1 for c in rows_per_rollout),
        "max_rows_per_rollout": max(rows_per_rollout, default=0),
        **{f"dropped_rollouts/{cause}": n for cause, n in dropped.items()},
        "dropped_rows/zero_trained_tokens": n_zero_rows,
        "truncated/rows": counts.truncated_rows,
        "truncated/prompt_tokens": counts.truncated_prompt_tokens,
        "truncated/response_tokens": counts.truncated_response_tokens,
        "tokens/prompt": tokens_prompt,
        "tokens/observation": tokens_region - tokens_trained,
        "tokens/trained": tokens_trained,
        "tokens/non_pad": tokens_prompt + tokens_region,
        "tokens/cells": n_rows * (P + R),
        "tokens/trained_fraction": tokens_trained / (tokens_prompt + tokens_region)
        if n_rows
        else 0.0,
    }
    if level == "trajectory":
        metrics["breaks/total"] = len(records)
        for kind in DRIFT_KINDS:
            metrics[f"breaks/{kind}"] = sum(b.kind == kind for b in records)
        for kind in DRIFT_KINDS:
            metrics[f"recomputed_tokens/{kind}"] = sum(
                b.recomputed_tokens for b in records if b.kind == kind
            )
        metrics["length_splits"] = counts.length_splits
        metrics[f"recomputed_tokens/{LENGTH_SPLIT}"] = counts.length_split_recomputed
    return (batch, metrics, records) if return_breaks else (batch, metrics)
