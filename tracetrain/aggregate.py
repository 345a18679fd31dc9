"""aggregate: the turns of finished rollouts -> training rows (`TrainingBatch`) + metrics.

Levels (registered by name in LEVELS):

    transition : one row per turn; row = (prompt_k | response_k).
    trajectory : turn k joins the open row when prompt_k starts with the running context
                 c = prompt_{k-1} + response_{k-1}; the row's response region grows by
                 obs_k = prompt_k[len(c):] (mask 0) and response_k (mask 1). Otherwise the row is
                 closed, the break is classified (see drift.py), and a new row starts at turn k.
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

Speed: rows are planned per turn in Python (list slices, C-speed compares); the token ids are
written once into a flat int64 buffer, and the padded tensors are filled with `masked_scatter_`
from a boolean layout mask, so there is no per-token Python work and no int64 index tensor.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tracetrain.batch import TrainingBatch
from tracetrain.drift import DRIFT_KINDS, DriftBreak, classify_break, snippet
from tracetrain.types import LOGPROB_TOLERANCE, Rollout, RolloutState, TraceError, check_rollouts

LEVELS = ("transition", "trajectory")
OVERLONG_POLICIES = ("drop_rollout", "truncate", "error")
LENGTH_SPLIT = "length_split"


@dataclass
class _Part:
    """Turn `turn` inside a row: obs = prompt[obs_start:] (None: the row's first turn, no obs)."""

    turn: int
    obs_start: int | None
    response_len: int


@dataclass
class _Row:
    """Plan of one row; tokens are copied only when the batch is written."""

    rollout: int  # index into the input `rollouts`
    prompt_cut: int  # left-truncated prompt tokens
    parts: list[_Part] = field(default_factory=list)

    @property
    def first_turn(self) -> int:
        return self.parts[0].turn


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


def _limit_prompt(r: Rollout, k: int, n: int, max_len: int, overlong: str, counts: _Counts) -> int:
    """Left cut for a row that starts at turn k with an n-token prompt."""
    if n <= max_len:
        return 0
    if overlong == "drop_rollout":
        raise _Drop("overlong_prompt")
    if overlong == "error":
        raise TraceError(
            f"rollout {r.rollout_id!r}, turn {k}: prompt_ids has {n} tokens, over "
            f"max_prompt_length={max_len} (overlong='error')"
        )
    counts.truncated_prompt_tokens += n - max_len
    return n - max_len


def _limit_response(
    r: Rollout, k: int, n: int, max_len: int, overlong: str, counts: _Counts
) -> int:
    """Kept length of turn k's n-token response."""
    if n <= max_len:
        return n
    if overlong == "drop_rollout":
        raise _Drop("overlong_response")
    if overlong == "error":
        raise TraceError(
            f"rollout {r.rollout_id!r}, turn {k}: response_ids has {n} tokens, over "
            f"max_response_length={max_len} (overlong='error')"
        )
    counts.truncated_response_tokens += n - max_len
    return max_len


def _check_turn_shapes(r: Rollout) -> None:
    """O(1) guards against turns mutated after validation; the full check runs on failure."""
    for k, t in enumerate(r.turns):
        lp = t.response_logprobs
        if not t.prompt_ids or (lp is not None and len(lp) != len(t.response_ids)):
            t.validate(r.rollout_id, k)  # raises the precise TraceError


def _new_row(r, ri, k, max_p, max_r, overlong, counts) -> _Row:
    t = r.turns[k]
    cut = _limit_prompt(r, k, len(t.prompt_ids), max_p, overlong, counts)
    keep = _limit_response(r, k, len(t.response_ids), max_r, overlong, counts)
    counts.truncated_rows += int(cut > 0 or keep < len(t.response_ids))
    return _Row(ri, cut, [_Part(k, None, keep)])


def plan_transition(
    r: Rollout, ri: int, max_p: int, max_r: int, overlong: str, counts: _Counts, **_
):
    """One row per turn."""
    rows = [_new_row(r, ri, k, max_p, max_r, overlong, counts) for k in range(len(r.turns))]
    return rows, []


def plan_trajectory(
    r: Rollout,
    ri: int,
    max_p: int,
    max_r: int,
    overlong: str,
    counts: _Counts,
    tokenizer,
    want_records,
):
    """Merge turns while the prefix holds and the region fits; classify every break."""
    turns = r.turns
    rows = [_new_row(r, ri, 0, max_p, max_r, overlong, counts)]
    region = rows[0].parts[0].response_len
    breaks: list[tuple[int, str, int, int, str]] = []  # turn, kind, position, recomputed, snippet
    carried: list[tuple[int, int]] = []  # response spans inherited through the new row's prompt
    for k in range(1, len(turns)):
        prev, t = turns[k - 1], turns[k]
        lp, lr = len(prev.prompt_ids), len(prev.response_ids)
        ctx_len = lp + lr
        p = t.prompt_ids
        if len(p) >= ctx_len and p[:lp] == prev.prompt_ids and p[lp:ctx_len] == prev.response_ids:
            grow = len(p) - ctx_len + len(t.response_ids)
            if region + grow <= max_r:
                rows[-1].parts.append(_Part(k, ctx_len, len(t.response_ids)))
                region += grow
                continue
            row = _new_row(r, ri, k, max_p, max_r, overlong, counts)
            counts.length_splits += 1
            counts.length_split_recomputed += len(p) - row.prompt_cut
        else:
            context = prev.prompt_ids + prev.response_ids
            spans = carried + [
                (len(turns[j].prompt_ids), len(turns[j].prompt_ids) + len(turns[j].response_ids))
                for j in (part.turn for part in rows[-1].parts)
            ]
            kind, position = classify_break(context, p, spans, tokenizer)
            row = _new_row(r, ri, k, max_p, max_r, overlong, counts)
            text = snippet(context, p, position, tokenizer) if want_records else ""
            breaks.append((k, kind, position, len(p) - row.prompt_cut, text))
            # Tokens before `position` are the same in the new prompt: their spans carry over.
            carried = [(a, min(b, position)) for a, b in spans if a < position]
        rows.append(row)
        region = row.parts[0].response_len
    return rows, breaks


LEVEL_PLANNERS = {"transition": plan_transition, "trajectory": plan_trajectory}


def _check_args(level, max_prompt_length, max_response_length, pad_token_id, overlong):
    if level not in LEVEL_PLANNERS:
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


def _find_bad_input(rollouts: Sequence[Rollout], kept: Sequence[int]) -> None:
    """Slow path after a cheap vectorized check failed: full validation raises the clear error."""
    for ri in kept:
        r = rollouts[ri]
        for k, t in enumerate(r.turns):
            t.validate(r.rollout_id, k)
    raise TraceError("bad token id or logprob in the batch, but no turn fails validation")


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
    Per row: model_version = oldest model_version of its turns, -1 if any is unknown;
    rollout_logprobs is None when any kept turn lacks logprobs. Per rollout: reward (NaN if None)
    and state. Rollouts with no turns, and rows with zero trained tokens, are dropped and counted.

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

    # 1. Plan rows per rollout (Python per turn; no token copied yet).
    planner = LEVEL_PLANNERS[level]
    counts = _Counts()
    dropped = dict.fromkeys(
        ("no_turns", "overlong_prompt", "overlong_response", "no_trained_tokens"), 0
    )
    n_zero_rows = 0
    rows: list[_Row] = []
    records: list[DriftBreak] = []
    for ri, r in enumerate(rollouts):
        if r.reward is not None and (isinstance(r.reward, bool) or not math.isfinite(r.reward)):
            raise TraceError(f"rollout {r.rollout_id!r}: reward is {r.reward!r}; it must be finite")
        if not r.turns:
            dropped["no_turns"] += 1
            continue
        _check_turn_shapes(r)
        before = _Counts(**vars(counts))
        try:
            r_rows, r_breaks = planner(
                r, ri, max_prompt_length, max_response_length, overlong, counts,
                tokenizer=tokenizer, want_records=return_breaks,
            )  # fmt: skip
        except _Drop as drop:
            dropped[drop.cause] += 1
            counts = before  # a dropped rollout leaves no trace in the counts
            continue
        n_planned = len(r_rows)
        r_rows = [row for row in r_rows if any(part.response_len for part in row.parts)]
        n_zero_rows += n_planned - len(r_rows)
        if not r_rows:
            dropped["no_trained_tokens"] += 1
            continue
        rows.extend(r_rows)
        records.extend(DriftBreak(r.rollout_id, k, *rest) for k, *rest in r_breaks)

    # 2. Write every row's tokens once into flat buffers; collect per-row lengths and mask runs.
    ids, lps = array("q"), array("f")
    have_logprobs = True
    lp_len, region_len, row_version, run_len, run_trained = [], [], [], [], []
    kept: list[int] = []  # rollout indices in batch order
    rows_per_rollout: list[int] = []
    turn_index: list[int] = []
    try:
        for row in rows:
            r = rollouts[row.rollout]
            if not kept or kept[-1] != row.rollout:
                kept.append(row.rollout)
                rows_per_rollout.append(0)
            rows_per_rollout[-1] += 1
            turn_index.append(row.first_turn)
            first = r.turns[row.first_turn]
            prompt = first.prompt_ids
            ids.extend(prompt[row.prompt_cut :] if row.prompt_cut else prompt)
            lp_len.append(len(prompt) - row.prompt_cut)
            region = 0
            for part in row.parts:
                t = r.turns[part.turn]
                if part.obs_start is not None:
                    n_obs = len(t.prompt_ids) - part.obs_start
                    ids.extend(t.prompt_ids[part.obs_start :])
                    run_len.append(n_obs)
                    run_trained.append(False)
                    region += n_obs
                n = part.response_len
                full = n == len(t.response_ids)
                ids.extend(t.response_ids if full else t.response_ids[:n])
                run_len.append(n)
                run_trained.append(True)
                region += n
                if have_logprobs and t.response_logprobs is not None:
                    lps.extend(t.response_logprobs if full else t.response_logprobs[:n])
                else:
                    have_logprobs = False
            region_len.append(region)
            versions = [r.turns[part.turn].model_version for part in row.parts]
            row_version.append(-1 if None in versions else min(versions))
    except (TypeError, OverflowError):  # a non-int id slipped in after validation
        _find_bad_input(rollouts, [row.rollout for row in rows])

    # 3. Vectorized layout: left-padded prompt | right-padded response region.
    n_rows = len(rows)
    lp_t = torch.tensor(lp_len, dtype=torch.int64)
    lr_t = torch.tensor(region_len, dtype=torch.int64)
    if pad_to_limits:
        P, R = max_prompt_length, max_response_length
    else:
        P = int(lp_t.max()) if n_rows else 0
        R = int(lr_t.max()) if n_rows else 0
    flat = (
        torch.frombuffer(ids, dtype=torch.int64) if len(ids) else torch.zeros(0, dtype=torch.int64)
    )
    if flat.numel() and int(flat.min()) < 0:
        _find_bad_input(rollouts, kept)

    col = torch.arange(P + R)
    start = (P - lp_t).unsqueeze(1)  # first real column of each row
    valid = col >= start
    valid &= col < (P + lr_t).unsqueeze(1)
    input_ids = torch.full((n_rows, P + R), pad_token_id, dtype=torch.int64)
    input_ids.masked_scatter_(valid, flat)
    del flat, ids
    attention_mask = valid.to(torch.int64)
    position_ids = (col - start).clamp_(min=0)  # 0 on left pad; keeps counting over right pad
    trained = torch.repeat_interleave(
        torch.tensor(run_trained, dtype=torch.bool), torch.tensor(run_len, dtype=torch.int64)
    )
    response_mask = torch.zeros((n_rows, R), dtype=torch.bool)
    response_mask.masked_scatter_(valid[:, P:], trained)
    del valid, trained

    rollout_logprobs = None
    if have_logprobs:
        rollout_logprobs = torch.zeros((n_rows, R), dtype=torch.float32)
        if len(lps):
            flat_lp = torch.frombuffer(lps, dtype=torch.float32)
            if not bool(torch.isfinite(flat_lp).all()) or float(flat_lp.max()) > LOGPROB_TOLERANCE:
                _find_bad_input(rollouts, kept)
            rollout_logprobs.masked_scatter_(response_mask, flat_lp)
            del flat_lp

    rollout_index = torch.repeat_interleave(
        torch.arange(len(kept)), torch.tensor(rows_per_rollout, dtype=torch.int64)
    )
    batch = TrainingBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        rollout_ids=[rollouts[row.rollout].rollout_id for row in rows],
        group_ids=[rollouts[row.rollout].group_id for row in rows],
        turn_index=torch.tensor(turn_index, dtype=torch.int64),
        rollout_index=rollout_index,
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
    n_prompt, n_region = int(lp_t.sum()), int(lr_t.sum())
    n_trained = sum(n for n, tr in zip(run_len, run_trained, strict=True) if tr)
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
        "tokens/prompt": n_prompt,
        "tokens/observation": n_region - n_trained,
        "tokens/trained": n_trained,
        "tokens/non_pad": n_prompt + n_region,
        "tokens/cells": n_rows * (P + R),
        "tokens/trained_fraction": n_trained / (n_prompt + n_region) if n_rows else 0.0,
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
