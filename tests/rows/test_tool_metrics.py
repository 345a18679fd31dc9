"""A step's tools/* metrics (rows/tool_metrics.py) on hand-made rollouts with known totals: only
the rollouts offered tools count; tools/errors only when one of them reported tool errors."""

from __future__ import annotations

import pytest

from tracetrain.rows.tool_metrics import tool_metrics
from tracetrain.types import Rollout, ToolStats, Turn


def rollout(rid: str, *tools: ToolStats | None) -> Rollout:
    return Rollout(rid, "g", [Turn([1, 2], [3], tools=t) for t in tools], 1.0)


ROLLOUTS = [
    rollout("a", ToolStats(2, 1, 0), ToolStats(1, 0, 1), ToolStats(0, 0, 0)),  # 3 calls
    rollout("b", ToolStats(0, 2, 0), None),  # offered tools once, no call parsed
    rollout("c", None, ToolStats(1, 0, 0)),  # 1 call
    rollout("d", None, None),  # never offered tools: left out
    rollout("e"),  # no turn at all: left out
]


def test_the_means_and_totals_over_the_rollouts_offered_tools():
    out = tool_metrics(ROLLOUTS, {"a": 2.0, "c": 0.0, "d": 5.0})  # d's report is not counted
    assert out == {
        "tools/calls_per_rollout": pytest.approx((3 + 0 + 1) / 3),
        "tools/rollouts_with_call": pytest.approx(2 / 3),
        "tools/parse_failures": 3,
        "tools/unknown": 1,
        "tools/errors": 2,
    }
    assert type(out["tools/errors"]) is int


def test_no_errors_key_unless_reported_and_no_keys_without_tools():
    out = tool_metrics(ROLLOUTS, {"d": 4.0})
    assert "tools/errors" not in out and out["tools/unknown"] == 1
    assert tool_metrics(ROLLOUTS[3:], {"d": 1.0}) == {}
    assert tool_metrics([], {}) == {}
    assert tool_metrics(ROLLOUTS[:1], {"a": 1.5})["tools/errors"] == 1.5
