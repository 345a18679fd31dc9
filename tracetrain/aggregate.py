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
So each chain's last context is converted to int64 once (numpy); consecutive chains go into a
flat buffer with P zeros before and R zeros after (in chunks of about CHUNK_TOKENS tokens, to keep
the temporary small), and the padded [rows, P+R] tensors are gathered with a row index from a
sliding-window view of that buffer (`as_strided` + `index_select`).
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
CHUNK_TOKENS = 1 << 18  # chain tokens converted at a time: bounds the temporary buffer (2 MiB)


@dataclass
class _Row:
    """One row: chain coords [lo, lo + n_prompt) are its prompt; the next n_region, its region."""

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


@dataclass
class _Chunk:
    """Rows from `row0` on, whose chains fill one buffer: [P zeros | chains ... | R zeros]."""

    row0: int
    n_tokens: int  # buffer length so far (starts at P)
    ids_lists: list[list[int]] = field(default_factory=list)  # per chain: last prompt, response
    run_len: list[int] = field(default_factory=list)  # trained-token runs over the buffer
    run_trained: list[bool] = field(default_factory=list)
    lp_lists: list[list[float]] = field(default_factory=list)  # the rows' trained logprobs
    n_trained: int = 0

    def __post_init__(self) -> None:
        self.run_len.append(self.n_tokens)
        self.run_trained.append(False)


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


def _windows(buf: torch.Tensor, start: torch.Tensor, width: int, out: torch.Tensor) -> None:
    """out[i] = buf[start_i : start_i + width] for every i (no per-cell index)."""
    view = buf.as_strided((buf.numel() - width + 1, width), (1, 1))
    torch.index_select(view, 0, start, out=out)


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
    chunks: list[_Chunk] = []  # consecutive rows whose chains share one token buffer
    row_start: list[int] = []  # index of each row's first region token in its chunk's buffer
    row_version: list[int] = []
    have_logprobs = True
    for ri, plan in zip(kept, plans, strict=True):
        turns = rollouts[ri].turns
        chain_start: dict[int, int] = {}
        for row in plan.rows:
            if row.chain not in chain_start:  # emit the chain once, at its first row
                if not chunks or chunks[-1].n_tokens >= CHUNK_TOKENS:
                    chunks.append(_Chunk(len(row_start), P))
                ch = chunks[-1]
                chain_start[row.chain] = ch.n_tokens
                pos = 0
                for j in plan.chains[row.chain]:
                    t = turns[j]
                    ch.run_len += (len(t.prompt_ids) - pos, len(t.response_ids))
                    ch.run_trained += (False, True)
                    pos = len(t.prompt_ids) + len(t.response_ids)
                ch.ids_lists += (turns[j].prompt_ids, turns[j].response_ids)
                ch.n_tokens += pos
            row_start.append(chain_start[row.chain] + row.lo + row.n_prompt)
            # The row's trained tokens, in order: its turns' (kept) responses and their logprobs.
            lps = [turns[j].response_logprobs for j in row.turns]
            have_logprobs = have_logprobs and None not in lps
            if have_logprobs:
                lps[0] = lps[0][: row.keep] if row.keep < len(lps[0]) else lps[0]
                ch.lp_lists += lps
                ch.n_trained += row.n_trained
            versions = [turns[j].model_version for j in row.turns]
            row_version.append(-1 if None in versions else min(versions))

    # 3. Vectorized layout: left-padded prompt | right-padded response region. Row i is the
    # window of width P+R that starts P columns before its first region token. All outputs are
    # allocated first; then each chunk of rows is finished in turn, so every temporary is
    # chunk-sized and reuses the space of the previous chunk's.
    start = torch.tensor(row_start, dtype=torch.int64)
    first = (P - torch.tensor(n_prompt, dtype=torch.int64)).unsqueeze(1)  # first real column
    end = P + torch.tensor(n_region, dtype=torch.int64).unsqueeze(1)  # one past the last
    col = torch.arange(P + R)
    input_ids = torch.empty((n_rows, P + R), dtype=torch.int64)
    attention_mask = torch.empty((n_rows, P + R), dtype=torch.int64)
    response_mask = torch.empty((n_rows, R), dtype=torch.bool)
    rollout_logprobs = torch.zeros((n_rows, R), dtype=torch.float32) if have_logprobs else None
    position_ids = (col - first).clamp_(min=0)  # 0 on left pad; keeps counting over right pad
    for i, ch in enumerate(chunks):
        r0, r1 = ch.row0, chunks[i + 1].row0 if i + 1 < len(chunks) else n_rows
        ids = chained(repeat(0, P), chained.from_iterable(ch.ids_lists), repeat(0, R))
        buf = torch.from_numpy(np.fromiter(ids, np.int64, ch.n_tokens + R))
        if int(buf.min()) < 0:
            _find_bad_input([rollouts[ri] for ri in kept])
        _windows(buf, start[r0:r1] - P, P + R, out=input_ids[r0:r1])
        del buf
        valid = col >= first[r0:r1]
        valid &= col < end[r0:r1]
        input_ids[r0:r1].masked_fill_(valid.logical_not(), pad_token_id)
        attention_mask[r0:r1] = valid
        trained = torch.repeat_interleave(
            torch.tensor(ch.run_trained + [False], dtype=torch.bool),
            torch.tensor(ch.run_len + [R], dtype=torch.int64),
        )
        _windows(trained, start[r0:r1], R, out=response_mask[r0:r1])
        response_mask[r0:r1] &= valid[:, P:]
        del trained, valid
        if rollout_logprobs is not None:  # trained tokens in row-major order = the rows' logprobs
            lp = torch.from_numpy(
                np.fromiter(chained.from_iterable(ch.lp_lists), np.float32, ch.n_trained)
            )
            if ch.n_trained and (
                not bool(torch.isfinite(lp).all()) or float(lp.max()) > LOGPROB_TOLERANCE
            ):
                _find_bad_input([rollouts[ri] for ri in kept])
            rollout_logprobs[r0:r1].masked_scatter_(response_mask[r0:r1], lp)
            del lp

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
