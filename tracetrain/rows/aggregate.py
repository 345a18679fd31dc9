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
with the previous context (checked with C-speed list slice compares, which look at object
identity first); every turn's context (prompt + response) is then a prefix of the chain's last
context, and every row, at either level, is one contiguous slice [lo, hi) of it. So only each
chain's last context is read from Python ints, once, into an int64 buffer (`struct.pack_into`,
the cheapest bulk list -> int64 copy in the standard library; the transition level reads 0.8 M
ints instead of 3.5 M on the benchmark), and each row is one numpy slice copy out of it into the
padded output. Turns whose ids and logprobs are `array.array`s (how the store hands them to the
trainer) skip the Python ints altogether: their compares are memory compares and their reads
memory copies (`types.values_of`). The response mask and the logprobs are written per turn, straight from the
lists, into the row's region. position_ids and attention_mask take one vectorized pass each (a
window of a template; a broadcast compare). Outputs are allocated by numpy, which asks the
kernel for huge pages for large blocks (a third of the page-fault time of a plain allocation
here; with pad_token_id 0 the ids start as lazily zeroed memory). Chains are read in chunks of
about CHUNK_TOKENS tokens, so the only temporary is small. No per-token Python work and no
index tensor larger than one int64 per row.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
import torch

from tracetrain.rows.batch import TrainingBatch
from tracetrain.rows.drift import (
    DRIFT_KINDS,
    DriftBreak,
)
from tracetrain.rows.plan import Limits, Planned, Row, plan_rollouts
from tracetrain.types import (
    LOGPROB_TOLERANCE,
    Rollout,
    RolloutState,
    TraceError,
    check_rollouts,
    values_of,
)

LEVELS = ("transition", "trajectory")
OVERLONG_POLICIES = ("drop_rollout", "truncate", "error")
LENGTH_SPLIT = "length_split"
CHUNK_TOKENS = 1 << 18  # chain tokens read at a time: bounds the temporary int64 buffer (~2 MiB)


@dataclass
class _Chunk:
    """Chains read into one int64 buffer, and the rows to copy out of it."""

    n_tokens: int = 0
    pieces: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # (at, ri, k, ids)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (to, at, n) per row


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


def _find_bad_input(rollouts: Sequence[Rollout]) -> None:
    """Slow path after a cheap vectorized check failed: full validation raises the clear error."""
    for r in rollouts:
        for k, t in enumerate(r.turns):
            t.validate(r.rollout_id, k)
    raise TraceError("bad token id or logprob in the batch, but no turn fails validation")


def _copy_rows(
    chunk: _Chunk, ids_flat: np.ndarray, rollouts: Sequence[Rollout], kept: Sequence[Rollout]
) -> None:
    """Read the chunk's chains into int64 once, then copy each row's slice into place."""
    buf = np.empty(chunk.n_tokens, dtype=np.int64)
    for at, ri, k, ids in chunk.pieces:
        if isinstance(ids, array):  # one memory copy (Turn validated the type code)
            buf[at : at + len(ids)] = values_of(ids)
            continue
        try:  # the cheapest bulk list -> int64 copy in the standard library
            struct.pack_into(f"{len(ids)}q", buf, at * 8, *ids)
        except struct.error as e:  # not an int, or one too large for int64
            r = rollouts[ri]
            r.turns[k].validate(r.rollout_id, k)
            raise TraceError(
                f"rollout {r.rollout_id!r}, turn {k}: token ids must be ints that fit in int64 ({e})"
            ) from None
    if buf.size and int(buf.min()) < 0:
        _find_bad_input(kept)
    for to, at, n in chunk.copies:
        ids_flat[to : to + n] = buf[at : at + n]


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
    train_roles: Collection[str] | None = None,
):
    """Build the rows of `rollouts` (never modified) and count what happened.

    Only the turns of `train_roles` (None: every role) make rows, each role's turns chaining by
    their own prefix (roles.role_orders); a rollout whose trained roles made no call has no row.

    P, S (prompt/response widths) are the batch maxima, or the limits with pad_to_limits=True.
    position_ids are 0 on the left padding and keep counting over the right padding.
    Per row: model_version = oldest model_version of its turns, -1 if any is unknown;
    rollout_logprobs is None when any kept turn lacks logprobs. Per rollout: reward (NaN if None)
    and state. Rollouts with no turns, and rows with zero trained tokens, are dropped and counted.
    Turn contents are trusted to have passed Turn validation; what is cheap is checked again
    (lengths, negative ids, non-finite or positive logprobs, rewards, duplicate rollout ids, ids
    and logprobs that are not numbers or ids beyond int64: every value in the batch is read as a
    C number; only a bool among the ids would pass as 0 or 1).

    metrics: n_rollouts_in, n_rollouts, n_rows, n_multi_row_rollouts, max_rows_per_rollout,
    dropped_rollouts/{no_turns, overlong_prompt, overlong_response, no_trained_tokens},
    dropped_rows/zero_trained_tokens, truncated/{rows, prompt_tokens, response_tokens},
    tokens/{prompt, observation, trained, non_pad, cells}, tokens/trained_fraction (of non_pad);
    trajectory level only: breaks/{total, <kind>}, recomputed_tokens/{<kind>, length_split},
    length_splits.

    Steps: plan_rollouts -> fill_rows -> positions_and_attention -> the batch and its metrics.
    """
    _check_args(level, max_prompt_length, max_response_length, pad_token_id, overlong)
    if not isinstance(rollouts, Sequence):
        raise TypeError(f"rollouts must be a sequence of Rollout, got {type(rollouts).__name__}")
    check_rollouts(rollouts)
    lim = Limits(max_prompt_length, max_response_length, overlong)
    planned = plan_rollouts(rollouts, level, lim, tokenizer, return_breaks, train_roles)
    rows = [row for plan in planned.plans for row in plan.rows]
    if pad_to_limits:
        P, S = max_prompt_length, max_response_length
    else:
        P = max((row.n_prompt for row in rows), default=0)
        S = max((row.n_region for row in rows), default=0)
    filled = fill_rows(rollouts, planned, P, S, pad_token_id)
    batch = _batch(planned, rows, filled, P)
    metrics = _metrics(level, rollouts, planned, rows, P + S)
    if return_breaks:
        return batch, metrics, [DriftBreak(*b) for b in planned.breaks]
    return batch, metrics


class _Filled(NamedTuple):
    input_ids: np.ndarray  # [rows, P + S]
    response_mask: np.ndarray  # [rows, S]
    rollout_logprobs: np.ndarray | None  # [rows, S]; None when a kept turn lacks logprobs
    row_version: list[int]
    turn_spans: list[list[tuple[int, int, int]]]  # per row: (turn, first column in S, tokens)


def fill_rows(rollouts: Sequence[Rollout], planned: Planned, P: int, S: int,
              pad_token_id: int) -> _Filled:
    """Steps 2 and 3: allocate the outputs (numpy: huge pages for large blocks, fewer page
    faults), then write the rows chain by chain (Python per chain, row and turn; numpy copies; no
    per-token work). A row is the slice [lo, lo + n_prompt + n_region) of its chain's last
    context, placed to start at column P - n_prompt. Its trained tokens are its turns' responses
    in the region: response mask and logprobs are written there, turn by turn, from the lists."""
    W = P + S
    n_rows = sum(len(plan.rows) for plan in planned.plans)
    new = np.zeros if pad_token_id == 0 else partial(np.full, fill_value=pad_token_id)
    input_ids = new((n_rows, W), dtype=np.int64)
    response_mask = np.zeros((n_rows, S), dtype=np.bool_)
    rollout_logprobs = np.zeros((n_rows, S), dtype=np.float32)
    ids_flat, mask_flat, lp_flat = (
        a.reshape(-1) for a in (input_ids, response_mask, rollout_logprobs)
    )
    kept_rollouts = planned.rollouts
    row_version: list[int] = []
    turn_spans: list[list[tuple[int, int, int]]] = []
    have_logprobs = True
    chunk, i = _Chunk(), 0
    try:
        for ri, plan in zip(planned.kept, planned.plans, strict=True):
            turns = rollouts[ri].turns
            for c, group in groupby(plan.rows, key=attrgetter("chain")):
                k_last = plan.chains[c][-1]
                last = turns[k_last]
                at = chunk.n_tokens
                chunk.pieces += ((at, ri, k_last, last.prompt_ids),)
                chunk.pieces += ((at + len(last.prompt_ids), ri, k_last, last.response_ids),)
                chunk.n_tokens += len(last.prompt_ids) + len(last.response_ids)
                for row in group:
                    chunk.copies.append(
                        (i * W + P - row.n_prompt, at + row.lo, row.n_prompt + row.n_region)
                    )
                    to, n = i * S, row.keep  # where the turn's response lies in the region
                    end = oldest = None  # end of the previous context; oldest model version
                    spans = []
                    for j in row.turns:
                        t = turns[j]
                        if end is not None:
                            to += len(t.prompt_ids) - end  # observation tokens
                            n = len(t.response_ids)
                        mask_flat[to : to + n] = True
                        spans.append((j, to - i * S, n))
                        lps = t.response_logprobs
                        if lps is None:
                            have_logprobs = False
                        elif have_logprobs:
                            if isinstance(lps, array):
                                lp_flat[to : to + n] = values_of(lps)[:n]
                            else:
                                values = lps if n == len(lps) else lps[:n]
                                struct.pack_into(f"{n}f", lp_flat, 4 * to, *values)
                        to += n
                        end = len(t.prompt_ids) + len(t.response_ids)
                        v = t.model_version
                        if v is None or oldest == -1:
                            oldest = -1  # unknown
                        elif oldest is None or v < oldest:
                            oldest = v
                    row_version.append(oldest)
                    turn_spans.append(spans)
                    i += 1
                if chunk.n_tokens >= CHUNK_TOKENS:
                    _copy_rows(chunk, ids_flat, rollouts, kept_rollouts)
                    chunk = _Chunk()
        _copy_rows(chunk, ids_flat, rollouts, kept_rollouts)
    except struct.error:  # a logprob that is not a number
        _find_bad_input(kept_rollouts)
    if have_logprobs and n_rows:
        if not np.isfinite(rollout_logprobs).all() or rollout_logprobs.max() > LOGPROB_TOLERANCE:
            _find_bad_input(kept_rollouts)
    return _Filled(input_ids, response_mask, rollout_logprobs if have_logprobs else None,
                   row_version, turn_spans)


def positions_and_attention(n_prompt: torch.Tensor, n_region: torch.Tensor, P: int, W: int):
    """Step 4: position_ids (0 on the left padding, then 0, 1, 2, ...: a window of
    [0]*P + [0..P+S)) and attention_mask (1 from the row's first prompt column to the end of its
    region), one vectorized pass each. n_prompt, n_region: int64 [rows]."""
    n_rows = len(n_prompt)
    position_ids = torch.from_numpy(np.empty((n_rows, W), dtype=np.int64))
    template = torch.cat([torch.zeros(P, dtype=torch.int64), torch.arange(W)])
    _windows(template, n_prompt, W, out=position_ids)
    attention_mask = torch.from_numpy(np.empty((n_rows, W), dtype=np.int64))
    col = torch.arange(W)
    torch.ge(col[:P], (P - n_prompt).unsqueeze(1), out=attention_mask[:, :P])
    torch.lt(col[P:], P + n_region.unsqueeze(1), out=attention_mask[:, P:])
    return position_ids, attention_mask


def _batch(planned: Planned, rows: list[Row], filled: _Filled, P: int) -> TrainingBatch:
    kept_rollouts = planned.rollouts
    position_ids, attention_mask = positions_and_attention(
        torch.tensor([row.n_prompt for row in rows], dtype=torch.int64),
        torch.tensor([row.n_region for row in rows], dtype=torch.int64),
        P, filled.input_ids.shape[1])
    rows_per_rollout = planned.rows_per_rollout
    per_row = list(zip(kept_rollouts, rows_per_rollout, strict=True))
    logprobs = filled.rollout_logprobs
    return TrainingBatch(
        input_ids=torch.from_numpy(filled.input_ids),
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=torch.from_numpy(filled.response_mask),
        rollout_logprobs=None if logprobs is None else torch.from_numpy(logprobs),
        rollout_ids=[r.rollout_id for r, c in per_row for _ in range(c)],
        group_ids=[r.group_id for r, c in per_row for _ in range(c)],
        turn_index=torch.tensor([row.turns[0] for row in rows], dtype=torch.int64),
        rollout_index=torch.repeat_interleave(
            torch.arange(len(kept_rollouts)), torch.tensor(rows_per_rollout, dtype=torch.int64)
        ),
        rollouts=[r.rollout_id for r in kept_rollouts],
        rewards=torch.tensor(
            [math.nan if r.reward is None else float(r.reward) for r in kept_rollouts],
            dtype=torch.float32,
        ),
        rollout_states=[RolloutState(r.state).value for r in kept_rollouts],
        model_version=torch.tensor(filled.row_version, dtype=torch.int64),
        turn_spans=filled.turn_spans,
    )


def _metrics(level: str, rollouts: Sequence[Rollout], planned: Planned, rows: list[Row],
             width: int) -> dict[str, float]:
    """Step 5: the counts `aggregate` returns (its docstring lists the keys)."""
    rows_per_rollout = planned.rows_per_rollout
    counts, breaks = planned.counts, planned.breaks
    tokens_prompt = sum(row.n_prompt for row in rows)
    tokens_region = sum(row.n_region for row in rows)
    tokens_trained = sum(row.n_trained for row in rows)
    metrics: dict[str, float] = {
        "n_rollouts_in": len(rollouts),
        "n_rollouts": len(planned.kept),
        "n_rows": len(rows),
        "n_multi_row_rollouts": sum(c > 1 for c in rows_per_rollout),
        "max_rows_per_rollout": max(rows_per_rollout, default=0),
        **{f"dropped_rollouts/{cause}": n for cause, n in planned.dropped.items()},
        "dropped_rows/zero_trained_tokens": planned.n_zero_rows,
        "truncated/rows": counts.truncated_rows,
        "truncated/prompt_tokens": counts.truncated_prompt_tokens,
        "truncated/response_tokens": counts.truncated_response_tokens,
        "tokens/prompt": tokens_prompt,
        "tokens/observation": tokens_region - tokens_trained,
        "tokens/trained": tokens_trained,
        "tokens/non_pad": tokens_prompt + tokens_region,
        "tokens/cells": len(rows) * width,
        "tokens/trained_fraction": tokens_trained / (tokens_prompt + tokens_region)
        if rows
        else 0.0,
    }
    if level == "trajectory":
        metrics["breaks/total"] = len(breaks)
        for kind in DRIFT_KINDS:
            metrics[f"breaks/{kind}"] = sum(b[2] == kind for b in breaks)
        for kind in DRIFT_KINDS:
            metrics[f"recomputed_tokens/{kind}"] = sum(b[4] for b in breaks if b[2] == kind)
        metrics["length_splits"] = counts.length_splits
        metrics[f"recomputed_tokens/{LENGTH_SPLIT}"] = counts.length_split_recomputed
    return metrics
