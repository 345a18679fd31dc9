"""aggregate: turns -> rows. Layout against a slow reference, merge invariants (hypothesis),
levels agree on trained tokens, no input mutation, drops and truncation counted, bad input named."""

import copy
import math
from collections import Counter
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracetrain.rows.aggregate as aggregate_module
from tracetrain.rows.aggregate import aggregate
from tracetrain.types import Rollout, TraceError, Turn

V = 50  # vocabulary of the generated traces
BIG = 10_000  # limits nothing reaches


def agg(rollouts, **kw):
    kw.setdefault("max_prompt_length", BIG)
    kw.setdefault("max_response_length", BIG)
    return aggregate(rollouts, **kw)


# ------------------------------------------------------------------ an independent slow reference


def starts_with(ids, prefix):
    if len(ids) < len(prefix):
        return False
    for i in range(len(prefix)):
        if ids[i] != prefix[i]:
            return False
    return True


def reference_rows(rollouts, level, max_p=BIG, max_r=BIG, overlong="truncate"):
    """[(rollout_id, first_turn, prompt, region, mask, logprobs)], token by token.

    Trajectory rows grow while the prefix holds and the region fits in max_r; a row's prompt
    keeps its last max_p tokens, a row-starting response its first max_r (or, with
    overlong="drop_rollout", the rollout is left out).
    """
    rows = []
    for r in rollouts:
        mine, cur, context = [], None, None
        for k, t in enumerate(r.turns):
            lps = t.response_logprobs
            lps = list(lps) if lps is not None else [None] * len(t.response_ids)
            if level == "trajectory" and cur is not None and starts_with(t.prompt_ids, context):
                obs = t.prompt_ids[len(context) :]
                if len(cur[3]) + len(obs) + len(t.response_ids) <= max_r:
                    cur[3] += obs + list(t.response_ids)
                    cur[4] += [0] * len(obs) + [1] * len(t.response_ids)
                    cur[5] += [0.0] * len(obs) + lps
                    context = list(t.prompt_ids) + list(t.response_ids)
                    continue
            prompt, resp = list(t.prompt_ids), list(t.response_ids)
            if len(prompt) > max_p or len(resp) > max_r:
                if overlong == "drop_rollout":
                    mine = []
                    break
                prompt = prompt[len(prompt) - min(len(prompt), max_p) :]
                resp, lps = resp[:max_r], lps[:max_r]
            cur = [r.rollout_id, k, prompt, resp, [1] * len(resp), lps]
            mine.append(cur)
            context = list(t.prompt_ids) + list(t.response_ids)
        rows += mine
    return rows


def reference_layout(rows, pad):
    """Padded lists built cell by cell: left-padded prompt, right-padded region."""
    P = max(len(row[2]) for row in rows)
    R = max(len(row[3]) for row in rows)
    ids, att, pos, mask, lp = [], [], [], [], []
    for _, _, prompt, region, m, lps in rows:
        left = P - len(prompt)
        ids.append([pad] * left + prompt + region + [pad] * (R - len(region)))
        att.append([0] * left + [1] * (len(prompt) + len(region)) + [0] * (R - len(region)))
        pos.append([max(0, c - left) for c in range(P + R)])
        mask.append(m + [0] * (R - len(region)))
        lp.append(
            [0.0 if (v is None or not mm) else v for v, mm in zip(lps, m, strict=True)]
            + [0.0] * (R - len(region))
        )
    return P, R, ids, att, pos, mask, lp


# ------------------------------------------------------------------ random multi-turn rollouts


@st.composite
def rollout_lists(draw, max_rollouts=4, max_turns=5):
    n = draw(st.integers(1, max_rollouts))
    tokens = st.integers(0, V - 1)
    out = []
    for i in range(n):
        with_lp = draw(st.booleans()) or draw(st.booleans())  # mostly with logprobs
        prompt = draw(st.lists(tokens, min_size=1, max_size=6))
        turns = []
        for _ in range(draw(st.integers(1, max_turns))):
            resp = draw(st.lists(tokens, min_size=1, max_size=5))
            lps = [-draw(st.floats(0, 5, allow_nan=False)) for _ in resp] if with_lp else None
            version = draw(st.one_of(st.none(), st.integers(0, 9)))
            turns.append(Turn(prompt, resp, lps, version))
            context = prompt + resp
            change = draw(st.sampled_from(["extend", "extend", "edit", "cut_left", "cut_right"]))
            if change == "edit":  # one token of the context changes: in a prompt or a response
                p = draw(st.integers(0, len(context) - 1))
                context = context[:p] + [(context[p] + 1) % V] + context[p + 1 :]
            elif change == "cut_left":  # old context dropped (truncation)
                context = context[draw(st.integers(1, len(context))) :]
            elif change == "cut_right":  # the end rewritten (e.g. reasoning stripped)
                context = context[: draw(st.integers(0, len(context) - 1))]
            prompt = context + draw(st.lists(tokens, min_size=0 if context else 1, max_size=4))
        out.append(
            Rollout(f"r{i}", f"g{i % 2}", turns, draw(st.one_of(st.none(), st.floats(-1, 1))))
        )
    return out


def row_spans(batch, r):
    """Rows of rollout r as (row, first_turn, last_turn)."""
    rows = [i for i, x in enumerate(batch.rollout_ids) if x == r.rollout_id]
    firsts = [int(batch.turn_index[i]) for i in rows]
    ends = [b - 1 for b in firsts[1:]] + [len(r.turns) - 1]
    return list(zip(rows, firsts, ends, strict=True))


def row_parts(batch, i):
    """(prompt, region, mask, logprobs) of row i without padding."""
    att = batch.attention_mask[i].bool()
    P = batch.prompt_length
    prompt = batch.input_ids[i, :P][att[:P]].tolist()
    n = int(att[P:].sum())
    region = batch.input_ids[i, P : P + n].tolist()
    mask = batch.response_mask[i, :n].tolist()
    lps = None if batch.rollout_logprobs is None else batch.rollout_logprobs[i, :n].tolist()
    return prompt, region, mask, lps


def f32(xs):
    return torch.tensor(xs, dtype=torch.float32).tolist()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollouts=rollout_lists())
def test_trajectory_merge_invariants(rollouts):
    """Every response token once with mask 1, every observation token with mask 0, in order;
    a row grows exactly while the prefix holds."""
    batch, m = agg(rollouts)
    assert batch.rollouts == [r.rollout_id for r in rollouts]
    for r in rollouts:
        turns = r.turns
        spans = row_spans(batch, r)
        starts = [a for _, a, _ in spans]
        assert starts[0] == 0 and starts == sorted(starts)
        for k in range(1, len(turns)):
            prefix = turns[k - 1].prompt_ids + turns[k - 1].response_ids
            holds = turns[k].prompt_ids[: len(prefix)] == prefix
            assert (k in starts) == (not holds), f"turn {k}: prefix holds={holds}"
        trained_all = []
        for i, a, b in spans:
            prompt, region, mask, lps = row_parts(batch, i)
            assert prompt == turns[a].prompt_ids
            assert prompt + region == turns[b].prompt_ids + turns[b].response_ids
            trained = [t for t, mm in zip(region, mask, strict=True) if mm]
            observed = [t for t, mm in zip(region, mask, strict=True) if not mm]
            assert trained == [tok for k in range(a, b + 1) for tok in turns[k].response_ids]
            obs = []
            for k in range(a + 1, b + 1):
                obs += turns[k].prompt_ids[
                    len(turns[k - 1].prompt_ids) + len(turns[k - 1].response_ids) :
                ]
            assert observed == obs
            trained_all += trained
            if lps is not None:
                want = [v for k in range(a, b + 1) for v in turns[k].response_logprobs]
                assert [v for v, mm in zip(lps, mask, strict=True) if mm] == f32(want)
                assert all(v == 0.0 for v, mm in zip(lps, mask, strict=True) if not mm)
        assert trained_all == [tok for t in turns for tok in t.response_ids]
    assert m["tokens/trained"] == sum(len(t.response_ids) for r in rollouts for t in r.turns)
    assert m["breaks/total"] == sum(len(row_spans(batch, r)) - 1 for r in rollouts)
    assert m["n_rows"] == batch.n_rows


def assert_layout(batch, rows, pad, rollouts):
    P, R, ids, att, pos, mask, lp = reference_layout(rows, pad)
    assert (batch.prompt_length, batch.response_length) == (P, R)
    assert batch.input_ids.tolist() == ids
    assert batch.attention_mask.tolist() == att
    assert batch.position_ids.tolist() == pos
    assert batch.response_mask.tolist() == [[bool(x) for x in row] for row in mask]
    assert (
        batch.input_ids.dtype
        == batch.attention_mask.dtype
        == batch.position_ids.dtype
        == torch.int64
    )
    assert batch.response_mask.dtype == torch.bool
    kept = set(batch.rollouts)
    if any(t.response_logprobs is None for r in rollouts if r.rollout_id in kept for t in r.turns):
        assert batch.rollout_logprobs is None
    else:
        assert batch.rollout_logprobs.dtype == torch.float32
        assert batch.rollout_logprobs.tolist() == [f32(row) for row in lp]
    assert batch.rollout_ids == [row[0] for row in rows]
    assert batch.turn_index.tolist() == [row[1] for row in rows]
    by_id = {r.rollout_id: r for r in rollouts}
    assert batch.group_ids == [by_id[row[0]].group_id for row in rows]
    assert batch.rollout_index.tolist() == [batch.rollouts.index(row[0]) for row in rows]
    # model_version: the oldest version of the row's turns (first turn .. the next row's first)
    starts = [(row[0], row[1]) for row in rows]
    versions = []
    for n, (rid, first) in enumerate(starts):
        nxt = starts[n + 1][1] if n + 1 < len(starts) and starts[n + 1][0] == rid else None
        turns = by_id[rid].turns[first:nxt]
        vs = [t.model_version for t in turns]
        versions.append(-1 if None in vs else min(vs))
    assert batch.model_version.tolist() == versions


@settings(max_examples=100, deadline=None)
@given(
    rollouts=rollout_lists(),
    level=st.sampled_from(["transition", "trajectory"]),
    pad=st.integers(0, 3),
    chunk=st.sampled_from([1, 7, aggregate_module.CHUNK_TOKENS]),
)
def test_layout_matches_slow_reference(rollouts, level, pad, chunk):
    with mock.patch.object(aggregate_module, "CHUNK_TOKENS", chunk):  # buffers cut into chunks
        batch, _ = agg(rollouts, level=level, pad_token_id=pad)
    assert_layout(batch, reference_rows(rollouts, level), pad, rollouts)


@settings(max_examples=100, deadline=None)
@given(
    rollouts=rollout_lists(),
    level=st.sampled_from(["transition", "trajectory"]),
    overlong=st.sampled_from(["truncate", "drop_rollout"]),
    max_p=st.integers(1, 12),
    max_r=st.integers(1, 12),
    chunk=st.sampled_from([1, 7, aggregate_module.CHUNK_TOKENS]),
    pad=st.sampled_from([0, 3]),
)
def test_layout_with_small_limits_matches_slow_reference(
    rollouts, level, overlong, max_p, max_r, chunk, pad
):
    """Rows cut by length inside a chain, truncated prompts and responses, dropped rollouts."""
    with mock.patch.object(aggregate_module, "CHUNK_TOKENS", chunk):
        batch, m = aggregate(
            rollouts,
            level=level,
            max_prompt_length=max_p,
            max_response_length=max_r,
            overlong=overlong,
            pad_token_id=pad,
        )
    rows = reference_rows(rollouts, level, max_p, max_r, overlong)
    if not rows:
        assert batch.n_rows == 0 and batch.rollouts == []
        return
    assert_layout(batch, rows, pad, rollouts)
    assert m["tokens/trained"] == sum(sum(row[4]) for row in rows)
    dropped = len(rollouts) - len({row[0] for row in rows})
    assert (
        m["dropped_rollouts/overlong_prompt"] + m["dropped_rollouts/overlong_response"] == dropped
    )
    if overlong == "truncate":
        full = {(r.rollout_id, k): t for r in rollouts for k, t in enumerate(r.turns)}
        cut = sum(len(full[row[0], row[1]].prompt_ids) - len(row[2]) for row in rows)
        assert m["truncated/prompt_tokens"] == cut


@settings(max_examples=100, deadline=None)
@given(rollouts=rollout_lists())
def test_levels_train_the_same_token_logprob_pairs_per_rollout(rollouts):
    def pairs(batch):
        out = {}
        for i, rid in enumerate(batch.rollout_ids):
            _, region, mask, lps = row_parts(batch, i)
            lps = lps if lps is not None else [None] * len(region)
            got = [(t, v) for t, v, mm in zip(region, lps, mask, strict=True) if mm]
            out.setdefault(rid, Counter()).update(got)
        return out

    a, _ = agg(rollouts, level="transition")
    b, _ = agg(rollouts, level="trajectory")
    assert pairs(a) == pairs(b)
    assert set(pairs(a)) == {r.rollout_id for r in rollouts}


def assert_same_batch(a, b):
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "turn_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("rollout_index", "model_version"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.rollout_logprobs is None) == (b.rollout_logprobs is None)
    if a.rollout_logprobs is not None:
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert torch.equal(a.rewards.nan_to_num(-7.0), b.rewards.nan_to_num(-7.0))
    assert (a.rollout_ids, a.group_ids, a.rollouts, a.rollout_states) == (
        b.rollout_ids,
        b.group_ids,
        b.rollouts,
        b.rollout_states,
    )


@settings(max_examples=60, deadline=None)
@given(rollouts=rollout_lists(), level=st.sampled_from(["transition", "trajectory"]))
def test_aggregate_never_modifies_its_input(rollouts, level):
    before = copy.deepcopy(rollouts)
    a, ma = agg(rollouts, level=level)
    b, mb = agg(rollouts, level=level)
    assert rollouts == before
    assert_same_batch(a, b)
    assert ma == mb


# ------------------------------------------------------------------ fields of the batch


def test_per_row_and_per_rollout_fields():
    r1 = Rollout(
        "a",
        "g1",
        [
            Turn([1, 2], [3], [-0.1], model_version=5),
            Turn([1, 2, 3, 4], [5], [-0.2], model_version=4),  # merged: oldest version 4
            Turn([9], [6], [-0.3], model_version=7),  # break: new row
        ],
        reward=None,
        state="succeeded",
    )
    r2 = Rollout(
        "b", "g2", [Turn([1], [2], [-0.5], None), Turn([1, 2], [3], [-0.5], 3)], 0.25, "timed_out"
    )
    batch, m = agg([r1, r2])
    assert batch.rollout_ids == ["a", "a", "b"] and batch.group_ids == ["g1", "g1", "g2"]
    assert batch.turn_index.tolist() == [0, 2, 0]
    assert batch.rollout_index.tolist() == [0, 0, 1]
    assert batch.model_version.tolist() == [4, 7, -1]  # any unknown version in a row -> -1
    assert batch.rollouts == ["a", "b"] and batch.rollout_states == ["succeeded", "timed_out"]
    assert (
        math.isnan(batch.rewards[0])
        and batch.rewards[1] == 0.25
        and batch.rewards.dtype == torch.float32
    )
    assert (m["n_rows"], m["n_rollouts"], m["n_multi_row_rollouts"], m["max_rows_per_rollout"]) == (
        3,
        2,
        1,
        2,
    )
    # tokens: prompts 2 + 1 + 1; regions (1 + 1 obs + 1) + 1 + (1 + 0 obs + 1)
    assert (m["tokens/prompt"], m["tokens/observation"], m["tokens/trained"]) == (4, 1, 5)
    assert m["tokens/non_pad"] == 10 == int(batch.attention_mask.sum())
    assert m["tokens/cells"] == 3 * (2 + 3) == batch.input_ids.numel()
    assert m["tokens/trained_fraction"] == pytest.approx(0.5)
    # the one logprob-less turn... none here; drop logprobs of one turn -> no logprob tensor
    r3 = Rollout("c", "g", [Turn([1], [2], None)])
    assert agg([r1, r3])[0].rollout_logprobs is None


@pytest.mark.parametrize(
    "versions,want", [([0, 5, 2], 0), ([5, 0, 2], 0), ([3, None, 1], -1), ([None, 4, 4], -1)]
)
def test_model_version_of_a_merged_row_is_its_oldest(versions, want):
    prompts = [[1], [1, 2, 3], [1, 2, 3, 4, 5]]  # each extends the previous context: one row
    turns = [Turn(p, [p[-1] + 1], None, v) for p, v in zip(prompts, versions, strict=True)]
    batch, _ = agg([Rollout("a", "g", turns)])
    assert batch.n_rows == 1 and batch.model_version.tolist() == [want]


def test_pad_to_limits_gives_fixed_widths():
    r = Rollout("a", "g", [Turn([1, 2], [3, 4, 5], [-1.0] * 3)])
    batch, m = aggregate(
        [r], max_prompt_length=6, max_response_length=4, pad_token_id=9, pad_to_limits=True
    )
    assert batch.input_ids.tolist() == [[9, 9, 9, 9, 1, 2, 3, 4, 5, 9]]
    assert batch.position_ids.tolist() == [[0, 0, 0, 0, 0, 1, 2, 3, 4, 5]]
    assert (batch.prompt_length, batch.response_length, m["tokens/cells"]) == (6, 4, 10)


# ------------------------------------------------------------------ drops, limits, overlong


def test_rollouts_without_turns_are_dropped_and_counted():
    rs = [
        Rollout("a", "g", [], None, "failed"),
        Rollout("b", "g", [Turn([1], [2])]),
        Rollout("c", "g", []),
    ]
    batch, m = agg(rs)
    assert (
        batch.rollouts == ["b"] and m["dropped_rollouts/no_turns"] == 2 and m["n_rollouts_in"] == 3
    )
    empty, m = agg(rs[:1])
    assert empty.n_rows == 0 and empty.rollouts == [] and m["n_rows"] == 0


def test_rows_with_zero_trained_tokens_are_dropped_and_counted():
    # Only reachable when a validated turn is emptied afterwards; aggregate must not emit the row.
    rs = [
        Rollout("a", "g", [Turn([5], [6], [-1.0]), Turn([1], [2], [-1.0])]),
        Rollout("b", "g", [Turn([1], [2], [-1.0])]),
    ]
    for t in (rs[0].turns[1], rs[1].turns[0]):
        t.response_ids, t.response_logprobs = [], []
    batch, m = agg(rs, level="transition")
    assert batch.rollout_ids == ["a"] and batch.n_rows == 1
    assert m["dropped_rows/zero_trained_tokens"] == 2
    assert m["dropped_rollouts/no_trained_tokens"] == 1
    assert (batch.response_mask.sum(1) > 0).all()


def make_long():
    # turn 0: prompt 4, response 3; turn 1 extends it: prompt 4+3+2 = 9, response 2
    return Rollout(
        "long",
        "g",
        [
            Turn([1, 2, 3, 4], [5, 6, 7], [-0.5, -0.6, -0.7]),
            Turn([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [-1.0, -1.1]),
        ],
    )


def test_overlong_drop_rollout_removes_the_whole_rollout_and_counts_the_cause():
    short = Rollout("short", "g", [Turn([1], [2], [-0.1])])
    for level in ("transition", "trajectory"):
        batch, m = aggregate(
            [make_long(), short], level=level, max_prompt_length=5, max_response_length=100
        )
        expect_drop = (
            level == "transition"
        )  # trajectory: the long prompt of turn 1 is merged, not a row prompt
        assert (batch.rollouts == ["short"]) == expect_drop, level
        assert m["dropped_rollouts/overlong_prompt"] == int(expect_drop)
    batch, m = aggregate([make_long(), short], max_prompt_length=100, max_response_length=2)
    assert batch.rollouts == ["short"] and m["dropped_rollouts/overlong_response"] == 1
    assert m["dropped_rollouts/overlong_prompt"] == 0 and m["truncated/rows"] == 0


def test_overlong_truncate_keeps_prompt_end_and_response_start_and_counts():
    batch, m = aggregate(
        [make_long()],
        level="transition",
        max_prompt_length=5,
        max_response_length=2,
        overlong="truncate",
    )
    prompts = [row_parts(batch, i)[0] for i in range(2)]
    regions = [row_parts(batch, i)[1] for i in range(2)]
    assert prompts == [[1, 2, 3, 4], [5, 6, 7, 8, 9]]  # last 5 of turn 1's 9-token prompt
    assert regions == [[5, 6], [10, 11]]  # first 2 of turn 0's 3-token response
    assert batch.rollout_logprobs[0].tolist() == f32([-0.5, -0.6])
    assert (m["truncated/prompt_tokens"], m["truncated/response_tokens"], m["truncated/rows"]) == (
        4,
        1,
        2,
    )
    assert m["tokens/trained"] == 4 and m["dropped_rollouts/overlong_prompt"] == 0
    assert batch.position_ids[1, batch.prompt_length - 5 :].tolist()[:7] == [0, 1, 2, 3, 4, 5, 6]


def test_overlong_error_names_rollout_turn_field_and_limit():
    with pytest.raises(
        TraceError,
        match=r"rollout 'long', turn 1: prompt_ids has 9 tokens, over max_prompt_length=5",
    ):
        aggregate(
            [make_long()],
            level="transition",
            max_prompt_length=5,
            max_response_length=9,
            overlong="error",
        )
    with pytest.raises(
        TraceError,
        match=r"rollout 'long', turn 0: response_ids has 3 tokens, over max_response_length=2",
    ):
        aggregate([make_long()], max_prompt_length=50, max_response_length=2, overlong="error")


def test_trajectory_row_that_would_overflow_the_response_width_is_split_and_counted():
    # merged region would be 3 + 2 obs + 2 = 7 > 6: turn 1 starts a new row instead
    batch, m = aggregate(
        [make_long()], max_prompt_length=50, max_response_length=6, return_breaks=True
    )[:2]
    assert batch.turn_index.tolist() == [0, 1] and batch.response_mask.sum().item() == 5
    assert (m["length_splits"], m["recomputed_tokens/length_split"], m["breaks/total"]) == (1, 9, 0)
    assert m["dropped_rollouts/overlong_response"] == 0
    batch, m = aggregate([make_long()], max_prompt_length=50, max_response_length=7)
    assert batch.n_rows == 1 and m["length_splits"] == 0


# ------------------------------------------------------------------ bad input through aggregate


def good():
    return [Rollout("a", "g", [Turn([1, 2], [3], [-0.1]), Turn([1, 2, 3, 4], [5], [-0.2])], 1.0)]


def mutate(field, value, turn=1):
    rs = good()
    setattr(rs[0].turns[turn], field, value)
    return rs


@pytest.mark.parametrize(
    "rollouts,words",
    [
        (mutate("prompt_ids", []), ["rollout 'a', turn 1: prompt_ids is empty"]),
        (mutate("prompt_ids", [1, 2, 3, -4]), ["rollout 'a', turn 1: prompt_ids[3] is -4"]),
        (mutate("response_ids", [-5], turn=0), ["rollout 'a', turn 0: response_ids[0] is -5"]),
        (
            mutate("response_logprobs", [-0.1, -0.2]),
            ["rollout 'a', turn 1: response_logprobs has 2 values"],
        ),
        (
            mutate("response_logprobs", [math.nan]),
            ["rollout 'a', turn 1: response_logprobs[0] is nan"],
        ),
        (
            mutate("response_logprobs", [-math.inf], turn=0),
            ["rollout 'a', turn 0: response_logprobs[0] is -inf"],
        ),
        (mutate("response_logprobs", [3.0]), ["rollout 'a', turn 1: response_logprobs[0] is 3.0"]),
    ],
)
@pytest.mark.parametrize("level", ["transition", "trajectory"])
def test_bad_turn_changed_after_validation_is_caught_by_aggregate(rollouts, words, level):
    # What is cheap to re-check is re-checked; element types are trusted to Turn validation.
    with pytest.raises(TraceError) as e:
        agg(rollouts, level=level)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("prompt_ids", [1, 2, 2.5, 4], ["rollout 'a', turn 1: prompt_ids[2] is 2.5", "float"]),
        ("response_ids", ["5"], ["rollout 'a', turn 1: response_ids[0] is '5'", "str"]),
        ("response_logprobs", ["x"], ["rollout 'a', turn 1: response_logprobs[0] is 'x'"]),
        ("prompt_ids", [1, 2, 3, 2**70], ["rollout 'a', turn 1: prompt_ids[3] is", "< 2**63"]),
    ],
)
@pytest.mark.parametrize("level", ["transition", "trajectory"])
def test_ids_and_logprobs_that_are_no_numbers_changed_after_validation_are_named(
    field, value, words, level
):
    # Every token id and logprob that lands in the batch is read as a C number: a value that is
    # not one (or an id beyond int64) raises, naming the turn, instead of being coerced.
    with pytest.raises(TraceError) as e:
        agg(mutate(field, value), level=level)
    for w in words:
        assert w in str(e.value)


def test_bad_batch_input_raises_clear_errors():
    a = good()[0]
    with pytest.raises(TraceError, match="rollout 'a': rollout_id appears more than once"):
        agg([a, copy.deepcopy(a)])
    bad_reward = good()
    bad_reward[0].reward = math.nan
    with pytest.raises(TraceError, match="rollout 'a': reward is nan"):
        agg(bad_reward)
    with pytest.raises(TraceError, match=r"rollouts\[0\] is a dict"):
        agg([{"rollout_id": "a"}])
    with pytest.raises(TypeError, match="rollouts must be a sequence"):
        agg(r for r in good())
    with pytest.raises(ValueError, match="level 'episode' is unknown"):
        agg(good(), level="episode")
    with pytest.raises(ValueError, match="overlong 'clip' is unknown"):
        agg(good(), overlong="clip")
    with pytest.raises(ValueError, match="max_prompt_length must be an int >= 1"):
        aggregate(good(), max_prompt_length=0, max_response_length=5)
    with pytest.raises(ValueError, match="pad_token_id must be an int >= 0"):
        agg(good(), pad_token_id=-1)
