"""The run page's curves: metric series -> SVG polylines (drawn by the template, no script).

    charts(steps) -> [Chart]   one per entry of CHARTS (the tools/* ones: rows/tool_metrics.py),
                               then one per environment metric (env/<name>, run/step.py), that has
                               at least one finite point

A chart maps step x to [LEFT, WIDTH - RIGHT] and value y to [HEIGHT - BOTTOM, TOP] linearly over
the finite points of its series (a flat series gets a range of +-1 around its value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 380, 160, 48, 10, 10, 22
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea")

CHARTS: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward_mean", "eval/reward_mean")),
    ("loss", ("loss",)),
    ("rows per rollout", ("rows_per_rollout",)),
    ("drift breaks by cause", ("aggregate/breaks/retokenization", "aggregate/breaks/assistant_rewrite",
                               "aggregate/breaks/context_rewrite")),
    ("mass per rollout x R", ("loss/rollout_mass_x_R_min", "loss/rollout_mass_x_R_max")),
    ("rollouts / s", ("rollouts_per_s",)),
    ("trained tokens / s", ("trained_tokens_per_s",)),
    ("step seconds", ("time/collect_s", "time/train_s")),
    ("peak memory GB", ("memory/peak_rss_gb",)),
    ("tool calls per rollout", ("tools/calls_per_rollout", "eval/tools/calls_per_rollout")),
    ("rollouts with a tool call", ("tools/rollouts_with_call", "eval/tools/rollouts_with_call")),
    ("tool failures", ("tools/parse_failures", "tools/unknown", "tools/errors")),
]


@dataclass
class Series:
    name: str
    color: str
    points: str  # "x,y x,y ..." in SVG coordinates
    last: float


@dataclass
class Chart:
    title: str
    series: list[Series]
    y_low: float
    y_high: float
    x_low: int
    x_high: int


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def env_charts(steps: list[dict]) -> list[tuple[str, tuple[str, ...]]]:
    """A chart per env/<name> key of `steps`, in the order the keys first appear."""
    names = dict.fromkeys(k for m in steps for k in m if k.startswith("env/"))
    return [(f"environment: {k.removeprefix('env/')}", (k,)) for k in names]


def charts(steps: list[dict]) -> list[Chart]:
    out = []
    for title, keys in CHARTS + env_charts(steps):
        data = {k: [(m["step"], float(m[k])) for m in steps if _finite(m.get(k))] for k in keys}
        data = {k: v for k, v in data.items() if v}
        if not data:
            continue
        xs = [x for v in data.values() for x, _ in v]
        ys = [y for v in data.values() for _, y in v]
        x0, x1 = min(xs), max(xs)
        y0, y1 = min(ys), max(ys)
        if y0 == y1:
            y0, y1 = y0 - 1, y1 + 1
        sx = (WIDTH - LEFT - RIGHT) / max(1, x1 - x0)
        sy = (HEIGHT - TOP - BOTTOM) / (y1 - y0)
        series = [
            Series(k, COLORS[n % len(COLORS)],
                   " ".join(f"{LEFT + (x - x0) * sx:.1f},{HEIGHT - BOTTOM - (y - y0) * sy:.1f}"
                            for x, y in v),
                   v[-1][1])
            for n, (k, v) in enumerate(data.items())
        ]
        out.append(Chart(title, series, y0, y1, x0, x1))
    return out
