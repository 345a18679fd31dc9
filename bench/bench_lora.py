"""Full fine-tuning vs LoRA on the calculator example (SmolLM2-135M-Instruct), side by side:
seconds per phase of a step and the process's peak memory.

    .venv/bin/python bench/bench_lora.py [--steps 3] [--rounds 2] [-- key=value ...]

Each variant is `tracetrain train` in its own process: examples/calculator/config.yaml (full
fine-tuning) and examples/calculator/lora.yaml (the same run with `model.lora`), `--steps` steps of
16 rollouts (4 tasks x 4), eval off, plus any overrides given after `--`. The variants alternate
(A B A B ...), `--rounds` times, because the shared VM's speed drifts. Printed per variant: the
median over steps after the first (which pays the one-time costs) of the step's collect, update
and total seconds (`time/collect_s`, `time/update_s`, steps of `time/elapsed_s`), the peak RSS of
the process (`wait4`'s ru_maxrss), and LoRA / full ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"full": ROOT / "examples/calculator/config.yaml", "lora": ROOT / "examples/calculator/lora.yaml"}


def run(config: Path, run_dir: Path, steps: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "tracetrain", "train", str(config), f"trainer.steps={steps}",
           f"trainer.run_dir={run_dir}", "trainer.eval_every=0", "trainer.checkpoint_every=0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["time/elapsed_s"] for r in rows]
    steady = rows[1:] or rows
    return {
        "collect_s": statistics.median(r["time/collect_s"] for r in steady),
        "update_s": statistics.median(r["time/update_s"] for r in steady),
        "step_s": statistics.median(b - a for a, b in zip(elapsed, elapsed[1:], strict=False))
        if len(elapsed) > 1 else elapsed[0],
        "peak_rss_gb": usage.ru_maxrss / 2**20,  # KiB on Linux
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("extra", nargs="*", help="key=value overrides for both variants")
    args = p.parse_args(argv)
    got: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as d:
        for k in range(args.rounds):
            for name, config in VARIANTS.items():
                out = run(config, Path(d) / f"{name}-{k}", args.steps, args.extra)
                got[name].append(out)
                print(f"  round {k} {name:<4}  collect {out['collect_s']:6.2f} s  "
                      f"update {out['update_s']:6.2f} s  "
                      f"step {out['step_s']:6.2f} s  peak RSS {out['peak_rss_gb']:.2f} GB", flush=True)
    best = {n: {key: min(r[key] for r in rs) for key in rs[0]} for n, rs in got.items()}
    for key in ("collect_s", "update_s", "step_s", "peak_rss_gb"):
        print(f"  {key:<12} full {best['full'][key]:7.2f}  lora {best['lora'][key]:7.2f}  "
              f"lora / full {best['lora'][key] / best['full'][key]:.2f}x   (best of {args.rounds})")


if __name__ == "__main__":
    main()
