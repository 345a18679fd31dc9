"""The run summary: gains and the step (and time) at which the target gain was first reached."""

from __future__ import annotations

import math

from tracetrain.run.report import moving_average, summary


def history(rewards, dt=2.0):
    return [{"step": k, "reward_mean": r, "time/elapsed_s": 30.0 + dt * (k + 1)}
            for k, r in enumerate(rewards)]


def test_target_gain_step_is_the_first_window_over_start_plus_gain():
    # first window mean 0.2; a window reaches 0.5 once it holds 5 ones among 10
    rewards = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0] + [1.0] * 10
    out = summary(history(rewards), window=10, target_gain=0.3)
    ma = moving_average(rewards, 10)
    want = next(k for k, v in enumerate(ma) if k >= 9 and v >= 0.2 + 0.3 - 1e-9)
    assert want == 12  # 3 more ones: 5/10 = 0.5
    assert out["reward_first_window"] == 0.2
    assert out["target_gain_step"] == 12
    assert out["target_gain_elapsed_s"] == 30.0 + 2.0 * 13
    assert math.isclose(out["reward_gain"], 0.8)


def test_target_gain_not_reached_is_none():
    out = summary(history([0.5] * 30), window=10, target_gain=0.3)
    assert out["target_gain_step"] is None and out["target_gain_elapsed_s"] is None


def test_a_window_not_yet_full_does_not_count():
    # an early spike in a partial window is not a 10-step mean
    rewards = [0.0, 1.0, 1.0] + [0.0] * 7 + [0.0] * 5
    out = summary(history(rewards), window=10, target_gain=0.3)
    assert out["target_gain_step"] is None


def test_the_untrained_baseline_is_the_reward_of_version_0_rollouts():
    # Fast learning: the untrained policy's rollouts (steps 0 and 1, version 0) score 0.4, the
    # first window already 0.82, so the first-window target (+0.3) is out of reach, the untrained
    # one is not: the first full window (steps 0-9) is already (2 x 0.4 + 8 x 0.9) / 10 = 0.8.
    rewards = [0.4, 0.4] + [0.9] * 8 + [0.9] * 5
    hist = history(rewards)
    for m in hist:
        m["rollout_model_version"] = max(0, m["step"] - 1)  # overlap: one version behind
    out = summary(hist, window=10, target_gain=0.3)
    assert math.isclose(out["reward_untrained"], 0.4)
    assert out["target_gain_step"] is None  # 0.82 + 0.3 > 1
    ma = moving_average(rewards, 10)
    want = next(k for k, v in enumerate(ma) if k >= 9 and v >= 0.4 + 0.3 - 1e-9)
    assert out["untrained_gain_step"] == want == 9
    assert out["untrained_gain_elapsed_s"] == 30.0 + 2.0 * 10


def test_without_model_versions_there_is_no_untrained_baseline():
    out = summary(history([0.1] * 12), window=10, target_gain=0.3)
    assert "reward_untrained" not in out and "untrained_gain_step" not in out
