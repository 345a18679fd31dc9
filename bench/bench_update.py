"""The update alone, variants side by side: one GRPO step's rows (bench_floor's step: SmolLM2-135M,
the calculator's prompts, 4 questions x 8 rollouts x 32 new tokens, trainer.precision auto), then
the update on those same rows again and again, the variants in turn (the order rotating each
round), each round's seconds per phase (time/update/*, learn/phases.py) and resident peak.

    .venv/bin/python bench/bench_update.py                    # every variant, 5 rounds
    .venv/bin/python bench/bench_update.py --variants today head --rounds 7

Variants (each a module switch; "today" is the update as it ships):
    autograd-head     the head's logprobs differentiated by autograd through checkpointed chunks
                      (packing.USE_HEAD_FUNCTION False), instead of learn/head.py's written-out
                      gradient
    recompute-logits  learn/head.py computing the logits again in the backward (KEEP_LOGITS_MB 0)
    gqa-repeat        a pack's attention with K and V copied per query head (sparse_pack.FOLD_GQA
                      False), as transformers' repeat_kv
The lr is 0 (AdamW still steps its moments), so every update sees the same weights. Printed per
variant: min and median update seconds, each phase's median, the peak, and each variant's median
over today's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

VARIANTS = {
    "today": {},
    "autograd-head": {("tracetrain.learn.packing", "USE_HEAD_FUNCTION"): False},
    "recompute-logits": {("tracetrain.learn.head", "KEEP_LOGITS_MB"): 0},
    "gqa-repeat": {("tracetrain.learn.sparse_pack", "FOLD_GQA"): False},
}


def switched(variant: str):
    """Set `variant`'s module switches; -> a function that puts them back."""
    import importlib

    old = {}
    for (mod, name), value in VARIANTS[variant].items():
        m = importlib.import_module(mod)
        old[(m, name)] = getattr(m, name)
        setattr(m, name, value)
    return lambda: [setattr(m, name, v) for (m, name), v in old.items()]


async def rows_of_one_step(args, work: Path):
    """(trainer, the update's input) of one bench_floor-shaped step (collect, rows; its update
    runs too, as the warm-up)."""
    from bench_grpo_smollm2 import smollm2_trainer
    from bench_train_step import serving
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    trainer = await smollm2_trainer(args, work)
    captured = []
    inner = trainer.learner.update

    def capture(w, **kw):
        captured.append(w)
        return inner(w, **kw)

    trainer.learner.update = capture
    async with serving(trainer) as stepper:
        await stepper.step()
    trainer.learner.update = inner
    return trainer, captured[-1]


def run(args) -> dict:
    import torch

    from tracetrain.models.compute import on_compute
    from tracetrain.run.memory import peak_rss_gb, reset_peak

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-update-") as tmp:
        trainer, work = asyncio.run(rows_of_one_step(args, Path(tmp)))
    learner = trainer.learner
    for group in learner.optimizer.param_groups:
        group["lr"] = 0.0
    results: dict[str, list[dict]] = {v: [] for v in args.variants}

    def one(variant: str) -> dict:
        restore = switched(variant)
        try:
            reset_peak()
            t = time.perf_counter()
            out = learner.update(work)
            wall = time.perf_counter() - t
            return {"update_s": wall, "peak_gb": peak_rss_gb(), **(out[0].times or {})}
        finally:
            restore()

    for v in args.variants:  # one untimed pass each (kernels, caches)
        on_compute(args.threads, one, v)
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
        for v in order:
            results[v].append(on_compute(args.threads, one, v))
    trainer.update_thread.close()
    summary = {}
    for v, runs in results.items():
        keys = sorted({k for x in runs for k in x})
        summary[v] = {"min_s": min(x["update_s"] for x in runs),
                      **{f"median_{k}": statistics.median(x[k] for x in runs) for k in keys}}
    base = summary.get("today")
    for s in summary.values():
        if base is not None:
            s["over_today"] = s["median_update_s"] / base["median_update_s"]
    return {"rows": int(work.batch.n_rows), "tokens": int(work.batch.attention_mask.sum()),
            "precision": trainer.cfg.trainer.precision, "threads": args.threads,
            "summary": summary, "runs": results}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--engine-precision", choices=["fp32", "bf16", "auto"], default="auto")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if "today" not in args.variants:
        args.variants = ["today", *args.variants]
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=1))
        return r
    from bench_floor import cpu_name

    print(f"CPU {cpu_name()}; {args.threads} threads; update precision {r['precision']}; "
          f"{r['rows']} rows, {r['tokens']} real tokens; {args.rounds} rounds")
    phases = sorted({k[len('median_time/update/'):-2] for s in r["summary"].values() for k in s
                     if k.startswith("median_time/update/")})
    print(f"{'variant':16s} {'min s':>7s} {'median s':>8s} {'/today':>7s} {'peak GB':>8s}  "
          + " ".join(f"{p:>9s}" for p in phases))
    for v, s in r["summary"].items():
        print(f"{v:16s} {s['min_s']:7.3f} {s['median_update_s']:8.3f} {s.get('over_today', 1):7.2f} "
              f"{s['median_peak_gb']:8.2f}  "
              + " ".join(f"{s.get(f'median_time/update/{p}_s', 0.0):9.3f}" for p in phases))
    return r


if __name__ == "__main__":
    main()
