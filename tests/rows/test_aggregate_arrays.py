"""Turns whose ids and logprobs are `array.array`s (what the store hands the trainer) aggregate to
exactly the batch, metrics and breaks of the same turns as lists, alone or mixed with lists."""

from __future__ import annotations

import copy
import random
from array import array

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_aggregate import BIG, assert_same_batch, rollout_lists

from tracetrain.rows.aggregate import aggregate
from tracetrain.rows.drift import break_position, first_difference
from tracetrain.types import Rollout, Turn

ID_KINDS = ("list", "i", "q", "H")
LP_KINDS = ("list", "f", "d")


def as_kind(values, kind):
    return list(values) if kind == "list" else array(kind, values)


@st.composite
def converted(draw, rollouts):
    """The same rollouts with every id / logprob field of every turn in a drawn container."""
    out = []
    for r in rollouts:
        turns = []
        for t in r.turns:
            lps = t.response_logprobs
            turns.append(Turn(
                as_kind(t.prompt_ids, draw(st.sampled_from(ID_KINDS))),
                as_kind(t.response_ids, draw(st.sampled_from(ID_KINDS))),
                None if lps is None else as_kind(lps, draw(st.sampled_from(LP_KINDS))),
                t.model_version,
            ))
        out.append(Rollout(r.rollout_id, r.group_id, turns, r.reward, r.state))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), level=st.sampled_from(["transition", "trajectory"]),
       limits=st.sampled_from([(BIG, BIG), (6, 7)]), overlong=st.sampled_from(["truncate", "drop_rollout"]))
def test_arrays_and_lists_give_the_same_rows(data, level, limits, overlong):
    rollouts = data.draw(rollout_lists())
    other = data.draw(converted(rollouts))
    before = copy.deepcopy(other)
    kw = dict(level=level, max_prompt_length=limits[0], max_response_length=limits[1],
              overlong=overlong, return_breaks=True)
    a, ma, ba = aggregate(rollouts, **kw)
    b, mb, bb = aggregate(other, **kw)
    assert_same_batch(a, b)
    assert ma == mb
    assert ba == bb
    assert other == before  # arrays are not modified either


def test_all_array_rollouts_from_the_store_layout():
    """int32 ids and float32 logprobs (the store's columns): a merged 2-turn row and a break."""
    t0 = Turn(array("i", [5, 6]), array("i", [7, 8]), array("f", [-0.5, -0.25]), 1)
    t1 = Turn(array("i", [5, 6, 7, 8, 9]), array("i", [10]), array("f", [-1.0]), 1)
    t2 = Turn(array("i", [5, 6, 7, 3, 9, 10, 11]), array("i", [12]), array("f", [-2.0]), 2)
    batch, m, breaks = aggregate([Rollout("r", "g", [t0, t1, t2], 1.0)], max_prompt_length=16,
                                 max_response_length=16, return_breaks=True)
    assert m["n_rows"] == 2 and m["breaks/assistant_rewrite"] == 1  # token 8 (a response) changed
    assert [(b.turn_index, b.position) for b in breaks] == [(2, 3)]
    row0 = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    assert row0 == [5, 6, 7, 8, 9, 10]
    assert batch.response_mask[0].tolist()[:4] == [True, True, False, True]
    assert batch.rollout_logprobs[0].tolist()[:4] == [-0.5, -0.25, 0.0, -1.0]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**32), data=st.data(),
       kinds=st.tuples(st.sampled_from(ID_KINDS), st.sampled_from(ID_KINDS)))
def test_first_difference_of_long_sequences_in_any_containers(n, seed, data, kinds):
    """Long enough that the bisection runs (it compares slices): lists and arrays, any mix."""
    rng = random.Random(seed)
    base = [rng.randrange(10) for _ in range(n)]
    other = list(base)
    if other and data.draw(st.booleans()):
        p = data.draw(st.integers(0, len(other) - 1))
        other[p] = (other[p] + 1) % 10
    other = other[: data.draw(st.integers(0, len(other)))] if data.draw(st.booleans()) else other
    naive = next((i for i, (x, y) in enumerate(zip(base, other, strict=False)) if x != y),
                 min(len(base), len(other)))
    a, b = as_kind(base, kinds[0]), as_kind(other, kinds[1])
    assert first_difference(a, b) == naive
    cut = data.draw(st.integers(0, len(base)))
    assert break_position(as_kind(base[:cut], kinds[0]), as_kind(base[cut:], kinds[1]), b) == naive
