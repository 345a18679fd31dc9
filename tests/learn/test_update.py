"""The update's own contract (learn/update.py): how many optimizer steps a step takes, what the
PPO ratio is taken against, what the first update measures before it steps, what each rollout
weighs in each update, what a rejected step does, and the lr schedule. Its agreement with the
plain padded update is in test_packing.py, with corrections in objective/test_correction.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_packing import shared_batch
from tiny_model import logprobs_and_entropy, tiny_causal_lm

from tracetrain.config import build_config
from tracetrain.learn.optim import lr_factor
from tracetrain.learn.update import ppo_update

GROUPS = [[1, 2], [2, 1, 1], [1, 3]]  # rows per rollout, per group: 7 rollouts, 11 rows


def own_logprobs(model, batch) -> torch.Tensor:
    """[N, L] the model's logprobs of the batch's response tokens (0 off the mask)."""
    with torch.no_grad():
        lp = logprobs_and_entropy(model, {"input_ids": batch.input_ids,
                                          "attention_mask": batch.attention_mask,
                                          "position_ids": batch.position_ids,
                                          "response_mask": batch.response_mask})[0]
    return lp * batch.response_mask


def config(**sections):
    optim = {"lr": 1e-2, "warmup_steps": 0, **sections.pop("optim", {})}
    return build_config({"optim": optim, **sections})


def model_and_batch(seed: int = 0):
    model = tiny_causal_lm(0)
    model.set_attn_implementation("eager")
    batch = shared_batch(seed, GROUPS, common=5, question=3)
    return model, batch


@pytest.mark.parametrize("mini_batches, epochs", [(1, 1), (2, 1), (3, 2), (9, 1)])
def test_one_optimizer_step_per_mini_batch_per_epoch(mini_batches, epochs):
    model, batch = model_and_batch()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    steps = []
    opt.register_step_post_hook(lambda *_: steps.append(1))
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(1))
    out = ppo_update(model, opt, batch, adv,
                     config(optim={"mini_batches": mini_batches, "ppo_epochs": epochs}))
    n = min(mini_batches, batch.n_rollouts) * epochs  # a mini-batch holds whole rollouts
    assert len(out) == len(steps) == n
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not model.training  # left in eval mode, as the engine samples from it
    # every rollout is in exactly one mini-batch of an epoch
    assert sum(r.metrics["n_rollouts"] for r in out[: n // epochs]) == batch.n_rollouts


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), mini_batches=st.integers(1, 4))
def test_each_rollout_weighs_one_over_its_updates_rollouts(seed, mini_batches):
    """rollout-mean: in each update every rollout's tokens carry 1/R of the mass (R its rollouts),
    however many rows it spans (docs/invariants.md, invariant 2: mass)."""
    model, _ = model_and_batch()
    batch = shared_batch(seed, GROUPS, common=4, question=2)
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(seed))
    out = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, adv,
                     config(optim={"mini_batches": mini_batches}))
    for r in out:
        assert r.metrics["rollout_mass_x_R_min"] == pytest.approx(1.0, rel=1e-6)
        assert r.metrics["rollout_mass_x_R_max"] == pytest.approx(1.0, rel=1e-6)
        assert r.metrics["weight_mass"] == pytest.approx(1.0, rel=1e-6)


def test_the_gap_is_measured_on_the_first_update_before_it_steps():
    model, batch = model_and_batch()
    own = own_logprobs(model, batch)
    shift = 0.25
    batch.rollout_logprobs = own + shift * batch.response_mask  # the engine's: off by exactly 0.25
    out = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), batch,
                     torch.ones(batch.n_rollouts), config(optim={"mini_batches": 2}), measure_gap=True)
    gap = out[0].logprob_gap
    # float32 logprobs of a tiny model: each within a few ulps of the padded forward's
    assert gap["mean"] == pytest.approx(shift, abs=1e-4) and gap["max"] == pytest.approx(shift, abs=1e-4)
    assert out[1].logprob_gap is None  # measured once, before any optimizer step
    assert ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch,
                      torch.ones(batch.n_rollouts), config())[0].logprob_gap is None  # not asked


@pytest.mark.parametrize("correction", [None, {"old": "trainer"}])
def test_the_ratio_is_taken_against_the_engines_logprobs_or_the_policys_own(correction):
    """Without engine logprobs, or with correction.old trainer, the first update is on-policy:
    ratio 1 on every token, nothing clipped, approx_kl 0. With the engine's logprobs 1 nat
    below the policy's, every token's ratio is e > 1 + clip_high: all clipped, A > 0."""
    model, batch = model_and_batch()
    sections = {} if correction is None else {"correction": correction}
    adv = torch.ones(batch.n_rollouts)
    on_policy = batch.select_rows(torch.arange(batch.n_rows))
    on_policy.rollout_logprobs = None if correction is None else own_logprobs(model, batch) + 1.0
    r = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), on_policy, adv, config(**sections))[0]
    assert r.metrics["clip_frac"] == 0.0 and r.metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    if correction is None:
        batch.rollout_logprobs = own_logprobs(model, batch) - 1.0
        r = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, adv, config())[0]
        assert r.metrics["clip_frac"] == pytest.approx(1.0)


def test_a_step_whose_every_rollout_is_rejected_takes_no_step():
    model, batch = model_and_batch()
    batch.rollout_logprobs = own_logprobs(model, batch) + 0.5  # every token's ratio e^-0.5
    before = [p.detach().clone() for p in model.parameters()]
    out = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, torch.ones(batch.n_rollouts),
                     config(correction={"old": "trainer", "weight": "rollout", "reject": [0.9, 1.1]}))
    assert len(out) == 1 and out[0].loss == 0.0 and out[0].metrics == {}
    assert out[0].correction["correction/rejected_rollouts"] == batch.n_rollouts
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("decay", ["constant", "cosine", "linear"])
def test_lr_factor_warms_up_linearly_then_decays(decay):
    warmup, total = 4, 12
    f = [lr_factor(s, warmup=warmup, total=total, decay=decay) for s in range(total + 2)]
    assert f[:warmup] == [1 / 4, 2 / 4, 3 / 4, 1.0]
    frac = [min(1.0, (s - warmup) / (total - warmup)) for s in range(warmup, total + 2)]
    want = {"constant": [1.0] * len(frac), "linear": [1 - x for x in frac],
            "cosine": [0.5 * (1 + math.cos(math.pi * x)) for x in frac]}[decay]
    assert f[warmup:] == pytest.approx(want)


@pytest.mark.parametrize("engine_logprobs, kl", [(True, 0.0), (False, 0.0), (True, 0.1)])
def test_the_update_times_each_phase_once_and_only_the_phases_it_ran(engine_logprobs, kl):
    """time/update/<phase>_s (learn/phases.py): the old-logprob pass runs only without the
    engine's logprobs, the reference pass only with KL on; the phases never overlap (their sum is
    within the update's wall time) and come in the update's order (old before any backward)."""
    import time

    from tracetrain.learn.phases import PHASES, Phases

    model, batch = model_and_batch()
    batch.rollout_logprobs = own_logprobs(model, batch) if engine_logprobs else None
    ref = tiny_causal_lm(0).eval() if kl else None
    if ref is not None:
        ref.set_attn_implementation("eager")
    ended: list[str] = []
    phases = Phases(on_end=ended.append)
    t = time.perf_counter()
    out = ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch,
                     torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(2)),
                     config(optim={"mini_batches": 2}, loss={"kl_coef": kl}), ref_model=ref,
                     phases=phases)
    wall = time.perf_counter() - t
    times = out[0].times
    assert sorted(times) == sorted(f"time/update/{p}_s" for p in PHASES)
    assert all(r.times is None for r in out[1:])  # the step's, once
    ran = {p for p in PHASES if times[f"time/update/{p}_s"] > 0}
    expected = {"pack", "forward", "loss", "backward", "optimizer"}
    expected |= set() if engine_logprobs else {"old"}
    expected |= {"reference"} if kl else set()
    assert ran == expected and set(ended) == expected
    assert sum(times.values()) <= wall
    assert ended.count("optimizer") == len(out)  # one optimizer step per update
    if not engine_logprobs:
        assert max(i for i, p in enumerate(ended) if p == "old") < ended.index("backward")
