"""The run page's curves (view/charts.py): the fixed charts, then one per environment metric."""

from __future__ import annotations

from tracetrain.view.charts import charts


def test_each_environment_metric_gets_its_own_curve():
    steps = [{"step": 0, "reward_mean": 0.1, "env/exact_match": 0.25},
             {"step": 1, "reward_mean": 0.3, "env/exact_match": 0.5, "env/format": 1.0},
             {"step": 2, "reward_mean": 0.2, "env/format": float("nan")}]
    by_title = {c.title: c for c in charts(steps)}
    assert list(by_title) == ["reward", "environment: exact_match", "environment: format"]
    match = by_title["environment: exact_match"]
    assert [s.name for s in match.series] == ["env/exact_match"]
    assert (match.x_low, match.x_high, match.y_low, match.y_high) == (0, 1, 0.25, 0.5)
    assert match.series[0].last == 0.5
    assert by_title["environment: format"].series[0].last == 1.0  # (NaN left out)
