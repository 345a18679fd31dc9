"""A step's tool use: what the rollouts' answers did with the tools they were offered.

    tool_metrics(rollouts, tool_errors) -> {"tools/calls_per_rollout": x, ...}

Over the rollouts offered tools at least once (a turn with `tools`, types.ToolStats: the gateway
counts them when a request offered tools and calls were parsed); {} when none was:

    tools/calls_per_rollout   mean over them of the tool calls parsed in the rollout
    tools/rollouts_with_call  the share of them with at least one parsed call
    tools/parse_failures      total calls begun that did not parse (tool_calls.py `opened`)
    tools/unknown             total parsed calls of a tool that was not offered
    tools/errors              total tool errors their harnesses reported (`tool_errors`,
                              types.TOOL_ERRORS, in each rollout's `metrics` event); only when
                              at least one of them reported it
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tracetrain.types import Rollout


def tool_metrics(rollouts: Sequence[Rollout], tool_errors: Mapping[str, float]) -> dict[str, float]:
    """The module docstring's tools/* over `rollouts`; `tool_errors`: rollout id -> the tool
    errors its harness reported (a rollout not in it reported none)."""
    offered = [r for r in rollouts if any(t.tools is not None for t in r.turns)]
    if not offered:
        return {}
    stats = [[t.tools for t in r.turns if t.tools is not None] for r in offered]
    calls = [sum(s.calls for s in mine) for mine in stats]
    out: dict[str, float] = {
        "tools/calls_per_rollout": sum(calls) / len(offered),
        "tools/rollouts_with_call": sum(c > 0 for c in calls) / len(offered),
        "tools/parse_failures": sum(s.parse_failures for mine in stats for s in mine),
        "tools/unknown": sum(s.unknown for mine in stats for s in mine),
    }
    reported = [tool_errors[r.rollout_id] for r in offered if r.rollout_id in tool_errors]
    if reported:
        total = math.fsum(reported)
        out["tools/errors"] = int(total) if total.is_integer() else total
    return out
