"""`tracetrain demo`: the example traces go through a real tokenizer and aggregate; each example
rollout shows the drift it was written for, and bad options fail with a message, not a traceback."""

import json
import subprocess
import sys

import pytest

from tracetrain.cli import main


@pytest.fixture(scope="module")
def demo_out():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = main(["rows"])
    return status, buf.getvalue()


def metric(out, key):
    (line,) = [ln for ln in out.splitlines() if ln.split()[:1] == [key]]
    return float(line.split()[1])


def test_demo_shows_each_drift_kind_on_its_example(demo_out):
    status, out = demo_out
    assert status == 0
    assert "rollout 'retokenized' turn 1: retokenization" in out
    assert "rollout 'reasoning-stripped' turn 1: assistant_rewrite" in out
    assert "rollout 'tool-output-summarised' turn 2: context_rewrite" in out
    assert metric(out, "breaks/total") == 3
    assert metric(out, "dropped_rollouts/no_turns") == 1  # the crashed rollout
    assert metric(out, "n_rows") == 7 and metric(out, "n_rollouts") == 4


def test_demo_rows_mark_trained_tokens(demo_out):
    _, out = demo_out
    clean = out[out.index("rollout 'clean'") :].split("\n\n")[0]
    # the clean rollout is one row: both responses trained, the tool result between them is not
    assert (
        "[[I will use the calculator. call: add(17, 25)<|end|>]]"
        "<|tool|>42<|end|><|assistant|>[[The answer is 42." in clean
    )
    assert "mask     15x1 4x0 6x1" in clean


def test_demo_transition_level_has_one_row_per_turn(tmp_path):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["rows", "--level", "transition"]) == 0
    out = buf.getvalue()
    assert metric(out, "n_rows") == 10 and "prefix breaks: none" in out


def test_demo_bad_trace_file_fails_cleanly(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    turn = {"prompt": "hi", "response": "yo"}
    bad.write_text(
        json.dumps(
            {
                "rollouts": [
                    {"rollout_id": "x", "group_id": "g", "turns": [turn], "reward": float("nan")}
                ]
            }
        )
    )
    assert main(["rows", "--traces", str(bad)]) == 2
    assert "error: rollout 'x': reward is nan" in capsys.readouterr().err
    # through the module entry point: exit status 2 and a message, no traceback
    (tmp_path / "empty").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "tracetrain", "rows", "--traces", str(tmp_path / "empty")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "tracetrain rows: error: no *.json trace files" in proc.stderr
    assert "Traceback" not in proc.stderr
    del turn["prompt"]
    bad.write_text(
        json.dumps({"rollouts": [{"rollout_id": "x", "group_id": "g", "turns": [turn]}]})
    )
    assert main(["rows", "--traces", str(bad)]) == 2
    assert "rollouts[0].turns[0]: missing field 'prompt'" in capsys.readouterr().err
