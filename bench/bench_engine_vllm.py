"""The demo's step with the local engine and with a real vLLM server, side by side; and the weight
sync's own time per MB of weights.

    .venv/bin/python bench/bench_engine_vllm.py                 # 12 steps per variant, 2 rounds
    .venv/bin/python bench/bench_engine_vllm.py --steps 20 --rounds 3 --sizes 128 256 512
    .venv/bin/python bench/bench_engine_vllm.py --no-steps      # the sync figures only

Needs vLLM's venv (bash scripts/install-vllm.sh; another interpreter with --vllm-python).

Steps: examples/guess/config.yaml (16 tasks x 8 rollouts, 2 mini-batches + KL, bf16-mixed
update), one warm start first; every variant resumes from its checkpoint in its own run
directory, `--rounds` times interleaved (the shared VM's speed drifts). Variants:
  local sequential   the in-process transformers engine, collect then update (weights shared)
  vllm sequential    engine.kind=vllm: collect through the server, update, sync (disk)
  local overlap      the demo's config as it is (the next collect beside the update)
  vllm overlap       the same through the server (its weights synced between two collects)
Printed per variant: medians over steps (the first after the resume left out: it pays for
start-up) of the step's wall time, collect, update and sync seconds, the best round, and each
variant's best step time relative to local sequential. The server's start-up is not a step.

Sync: for tiny Llama models of hidden size `--sizes` (4 layers), one server each; `--pushes`
pushes of new weights by `VLLMEngine.load_weights` (write model.safetensors, reload_weights,
reset_prefix_cache), timed whole and the file write alone; ms per push and MB/s of fp32 weights.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_demo_step import ROOT, run_rounds  # the demo config, warm-started once, in rounds
from bench_demo_step import summarize as step_times  # step, collect and update medians

SEQUENTIAL = ["trainer.collect=step", "trainer.update_threads=2"]


def variants(python: str) -> dict[str, list[str]]:
    vllm = ["engine.kind=vllm", f"engine.python={python}"]
    return {"local sequential": SEQUENTIAL, "vllm sequential": vllm + SEQUENTIAL,
            "local overlap": [], "vllm overlap": vllm}


def summarize(metrics: list[dict]) -> dict:
    """bench_demo_step's medians (the first step after the resume left out), and sync, the
    largest logprob gap and the mean reward."""
    ms = metrics[1:]
    gaps = [m["engine/logprob_gap_max"] for m in metrics if "engine/logprob_gap_max" in m]
    return {**step_times(metrics), "sync_s": statistics.median(m.get("time/sync_s", 0.0) for m in ms),
            "gap_max": max(gaps) if gaps else float("nan"),
            "reward": statistics.mean(m["reward_mean"] for m in ms)}


def steps_bench(args) -> None:
    results = run_rounds(
        variants(args.vllm_python), args.steps, args.rounds, summarize,
        lambda s: f"update {s['update_s']:.3f} s  sync {s['sync_s']:.3f} s  "
                  f"gap max {s['gap_max']:.1e}  reward {s['reward']:.3f}")
    base = min(s["step_s"] for s in results["local sequential"])
    print(f"\n{args.steps} steps per run, {args.rounds} rounds; medians over steps, best round shown")
    print(f"{'variant':18s} {'step s':>8s} {'collect s':>10s} {'update s':>9s} {'sync s':>7s} "
          f"{'vs local sequential':>20s}")
    for name, rows in results.items():
        b = min(rows, key=lambda s: s["step_s"])
        print(f"{name:18s} {b['step_s']:8.3f} {b['collect_s']:10.3f} {b['update_s']:9.3f} "
              f"{b['sync_s']:7.3f} {base / b['step_s']:19.2f}x")


async def time_pushes(server, tok, weights_dir: Path, model, pushes: int) -> tuple[float, float]:
    """Median seconds of one push of new weights, and of writing the file alone."""
    import torch

    from tracetrain.engines.vllm import VLLMEngine
    from tracetrain.models.save import write_weights

    engine = VLLMEngine(server, tok, weights_dir, max_context=512)
    times, writes = [], []
    try:
        for k in range(pushes):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            t = time.perf_counter()
            await engine.load_weights(model, k + 1)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            write_weights(model, weights_dir)
            writes.append(time.perf_counter() - t)
    finally:
        await engine.aclose()  # stops the server
    return statistics.median(times), statistics.median(writes)


def sync_bench(args) -> None:
    from tracetrain.engines.vllm_server import VLLMServer
    from tracetrain.models.save import untied_state_dict, write_hf_dir
    from tracetrain.models.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    print(f"\nweight sync by disk, {args.pushes} pushes per model (median), fp32")
    print(f"{'hidden':>6s} {'params':>8s} {'MB':>7s} {'push ms':>8s} {'write ms':>9s} {'MB/s':>7s}")
    for hidden in args.sizes:
        model = build_model(tok, hidden_size=hidden, num_heads=max(2, hidden // 32),
                            num_kv_heads=max(1, hidden // 64), seed=0)
        mb = sum(t.numel() * t.element_size() for t in untied_state_dict(model).values()) / 2**20
        with tempfile.TemporaryDirectory(prefix="tt-vllm-sync-") as tmp:
            d = write_hf_dir(model, tok, Path(tmp) / "weights")
            server = VLLMServer.launch(args.vllm_python, d, Path(tmp) / "vllm.log",
                                       max_model_len=512, dtype="float32")

            push, write = asyncio.run(time_pushes(server, tok, d, model, args.pushes))
        n = sum(p.numel() for p in model.parameters())
        print(f"{hidden:6d} {n / 1e6:7.2f}M {mb:7.1f} {push * 1e3:8.1f} {write * 1e3:9.1f} "
              f"{mb / push:7.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-steps", action="store_true", help="the sync figures only")
    ap.add_argument("--sizes", type=int, nargs="*", default=[128, 512, 1024])
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = ap.parse_args()
    if subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True).returncode:
        raise SystemExit(f"no vLLM at {args.vllm_python}: bash scripts/install-vllm.sh")
    if not args.no_steps:
        steps_bench(args)
    sync_bench(args)


if __name__ == "__main__":
    main()
