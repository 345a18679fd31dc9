"""bench/bench_context.py, small: two real gateway processes (exact, template) in front of the fake
upstream, agents resending their whole history with the tools. Its figures are the issue's goals:
under exact, zero prefix breaks and one row per rollout, fewer tokens forwarded and stored than
under template (which breaks where the model's own call text differs from the template's); its
in-process replay rebuilds every exact prompt the gateway recorded (checked inside the bench).
With --bare the same conversations go through bench/bare_gateway.py, the floor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_context  # noqa: E402


@pytest.mark.slow
def test_bench_context_exact_has_no_breaks_and_one_row_per_rollout(capsys):
    (pair,) = bench_context.main(["--turns", "6", "--clients", "3", "--repeats", "1", "--bare"])
    exact, template = pair["exact"], pair["template"]
    assert exact["breaks"] == 0 and exact["rows"] == 1.0
    # the scripted answers not written as the template writes a call break the template's prefix
    assert template["breaks"] > 0 and template["rows"] == pytest.approx(1 + template["breaks"])
    assert template["by_kind"]["assistant_rewrite"] == template["breaks"]
    assert exact["forward_tokens"] < template["forward_tokens"]
    assert exact["stored_kb"] < template["stored_kb"]
    for c in (exact, template):
        assert c["cpu_ms"] > 0 and c["prompt_exact_ms"] > 0 and c["prompt_template_ms"] > 0
    # the floor is measured on the same conversations: each agent sent as many messages each turn
    assert pair["bare"]["sent"] == exact["sent"] and len(exact["sent"]) == 3
    assert all(len(sent) == 6 and sent == sorted(set(sent)) for sent in exact["sent"])
    assert pair["bare"]["cpu_ms"] > 0
    out = capsys.readouterr().out
    assert "6 turns, medians of 1" in out and "at most" in out
