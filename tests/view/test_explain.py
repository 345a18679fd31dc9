"""explain_step (what `inspect` and `tracetrain view` show) against the loss invariants, on random
steps: multi-turn rollouts whose prompts sometimes break the running context, failed ones, every
loss mode and number of mini-batches."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.config import build_config
from tracetrain.types import Rollout, Turn
from tracetrain.view.explain import DROPPED, EXCLUDED, TRAINED, explain_step


@st.composite
def steps(draw):
    rollouts = []
    for g in range(draw(st.integers(1, 3))):
        for n in range(draw(st.integers(1, 4))):
            context, turns = [7] * draw(st.integers(1, 4)), []
            for _ in range(draw(st.integers(1, 4))):
                if turns and draw(st.booleans()):  # the running context, extended
                    prompt = context + draw(st.lists(st.integers(10, 40), min_size=1, max_size=3))
                else:  # a new prompt: the prefix breaks
                    prompt = draw(st.lists(st.integers(10, 40), min_size=1, max_size=8))
                response = draw(st.lists(st.integers(10, 40), min_size=1, max_size=5))
                turns.append(Turn(prompt, response, [-0.5] * len(response), 0))
                context = prompt + response
            state = draw(st.sampled_from(["succeeded", "succeeded", "failed"]))
            rollouts.append(Rollout(f"r{g}-{n}", f"s0-t{g}", turns,
                                    None if state == "failed" else draw(st.floats(0, 1)), state))
    return rollouts


@settings(max_examples=60, deadline=None)
@given(rollouts=steps(), mode=st.sampled_from(["rollout-mean", "token-mean", "seq-mean-token-mean",
                                                 "seq-mean-token-sum"]),
       mini_batches=st.integers(1, 3))
def test_token_weights_sum_to_each_rollouts_mass(rollouts, mode, mini_batches):
    cfg = build_config({}, [f"loss.mode={mode}", f"optim.mini_batches={mini_batches}",
                            "aggregate.max_prompt_length=64"])
    step = explain_step(rollouts, cfg)
    by_batch: dict[int, list[float]] = {}
    for r in rollouts:
        e = step.summary[r.rollout_id]
        if r.state == "failed":
            assert e.status in (EXCLUDED, DROPPED)
        if e.status != TRAINED:
            assert step.rows(r.rollout_id) == []
            continue
        rows = step.rows(r.rollout_id)
        weights = [w for row in rows for w in row.weight]
        kinds = [k for row in rows for k in row.kind]
        # every response token of the rollout is trained exactly once (nothing truncated here)
        assert kinds.count("trained") == e.trained_tokens == sum(len(t.response_ids) for t in r.turns)
        assert all(w == 0 for w, k in zip(weights, kinds, strict=True) if k != "trained")
        assert math.fsum(weights) == pytest.approx(e.mass, rel=1e-5)
        assert len(rows) == e.n_rows == 1 + len(e.breaks)
        by_batch.setdefault(e.mini_batch, []).append(e.mass)
    for masses in by_batch.values():  # invariant 2: each update's weights sum to 1 (mean modes)
        if mode != "seq-mean-token-sum":
            assert math.fsum(masses) == pytest.approx(1.0, rel=1e-5)
        if mode == "rollout-mean":  # invariant 1: 1/R each, however many rows
            assert all(m == pytest.approx(1 / len(masses), rel=1e-5) for m in masses)
