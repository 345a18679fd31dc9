"""scripts/gpu_check.sh: without CUDA it names the three GPU parts it would run and exits 0; the
harness (scripts/gpu_check.py) runs a part's commands under its time limit and judges its run from
metrics.jsonl."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)  # (its dataclass)
_spec.loader.exec_module(gpu_check)


def test_without_cuda_it_says_what_it_would_run_and_exits_0():
    # (on a CUDA machine the script would run the parts: --dry-run is what it does without one)
    extra = ["--dry-run"] if torch.cuda.is_available() else []
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "nothing is run" in out
    rows = {line.split(" | ")[0].strip(): line for line in out.splitlines() if " | " in line}
    assert {"embedded", "vllm", "verl"} <= rows.keys()
    assert all(" | would " in rows[p] for p in ("embedded", "vllm", "verl"))
    assert "trainer.device=cuda" in out and "engine kind vllm" in out
    assert "--backend verl" in out and "verl.n_gpus_per_node=1" in out


def lines(*ms: dict) -> list[dict]:
    return [{"step": k, "reward_mean": 0.5, "model_version": k + 1, "trained_tokens_per_s": 100.0,
             **m} for k, m in enumerate(ms)]


def test_the_vllm_part_wants_a_sync_after_each_update_and_each_steps_gap():
    ok, figures = gpu_check.judge_vllm(lines(
        *({"loss": 0.1, "rollout_model_version": v, "engine/logprob_gap_max": 2e-3} for v in range(3))))
    assert ok and "rollout versions 0,1,2" in figures and "2.0e-03" in figures
    stale, figures = gpu_check.judge_vllm(lines(
        *({"loss": 0.1, "rollout_model_version": v, "engine/logprob_gap_max": 2e-3} for v in (0, 0, 1))))
    assert not stale and "rollout versions 0,0,1" in figures
    no_gap, _ = gpu_check.judge_vllm(lines(*({"loss": 0.1, "rollout_model_version": v} for v in range(3))))
    assert not no_gap


def test_the_embedded_and_verl_parts_want_every_step_trained():
    assert gpu_check.judge_embedded(lines(*[{"loss": 0.1}] * 3))[0]
    assert not gpu_check.judge_embedded(lines(*[{"loss": 0.1}] * 2))[0]  # a step short
    assert not gpu_check.judge_embedded(lines({"loss": 0.1}, {}, {"loss": 0.1}))[0]  # no update
    assert gpu_check.judge_verl(lines({"loss": 0.1, "aggregate/n_rows": 16}))[0]
    assert not gpu_check.judge_verl(lines({}))[0]


def part(name: str, code: str, timeout_s: float = 60, missing=None):
    """A part whose command runs `code` (WORK/<name> as argv[1]) and whose judge wants 3 steps."""
    return gpu_check.Part(name, "a test part", "nothing", timeout_s,
                          lambda work: [[sys.executable, "-c", code, str(work / name)]],
                          lambda checked: missing, gpu_check.judge_embedded)


WRITE = ("import json, pathlib, sys; d = pathlib.Path(sys.argv[1]); d.mkdir(); (d / 'metrics.jsonl')"
         ".write_text(''.join(json.dumps({'step': k, 'loss': 0.1, 'reward_mean': 0.5, "
         "'model_version': k + 1, 'trained_tokens_per_s': 9.0}) + '\\n' for k in range(3)))")


def test_a_part_is_run_under_its_time_limit_and_judged_from_its_metrics(tmp_path):
    status, figures, _ = gpu_check.run_part(part("good", WRITE), tmp_path)
    assert status == "ok" and "reward 0.50/0.50/0.50" in figures
    status, figures, _ = gpu_check.run_part(
        part("crash", "import sys; print('RuntimeError: CUDA error: no kernel image'); sys.exit(3)"),
        tmp_path)
    assert status == "FAILED" and "exit 3: RuntimeError: CUDA error: no kernel image" in figures
    status, figures, seconds = gpu_check.run_part(part("slow", "import time; time.sleep(60)", 2),
                                                  tmp_path)
    assert status == "FAILED" and "over its 2 s" in figures and seconds < 30
    assert gpu_check.run_part(part("absent", WRITE, missing="no vLLM"), tmp_path)[:2] == \
        ("skipped", "no vLLM")
    table = gpu_check.table([("good", "ok", "reward 0.50", 12.3)])
    assert [c.strip() for c in table.splitlines()[0].split(" | ")] == ["part", "status", "figures", "seconds"]
    assert table.splitlines()[1].split(" | ")[-1] == "12"


@pytest.mark.parametrize("name", ["embedded", "vllm", "verl"])
def test_each_parts_command_is_a_config_tracetrain_accepts(tmp_path, name):
    """The config each GPU part trains with loads (the GPU itself is checked only when it runs)."""
    from tracetrain.config import load_config

    p = next(x for x in gpu_check.PARTS if x.name == name)
    p.prepare(tmp_path)
    argv = p.command(tmp_path)[-1]
    words = argv[argv.index("train") + 1:]
    words = [w for w in words if w not in ("--backend", "verl")]
    cfg = load_config(Path(words[0]), words[1:])
    assert cfg.trainer.run_dir == str(tmp_path / name)
    assert cfg.trainer.device == ("cpu" if name == "verl" else "cuda")
