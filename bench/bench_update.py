"""The update on a fixed batch of real recorded rollouts: each of packing, prefix sharing and
chunked logprobs on and off, side by side in one run; seconds and peak RSS of each.

    # once: a run of the calculator gives real rollouts; its first step's rows become the batch
    .venv/bin/python -m tracetrain train examples/calculator/config.yaml trainer.steps=1 \\
        trainer.eval_every=0 trainer.run_dir=runs/calc-batch
    .venv/bin/python bench/bench_update.py --run runs/calc-batch --save runs/calc-batch/batch.pt
    # then, as often as wanted, on the same rows:
    .venv/bin/python bench/bench_update.py --batch runs/calc-batch/batch.pt [--repeats 2]

Each measurement is one child process (so that its peak RSS is its own): it loads the run's
policy (the config's model, its initial weights; a copy as the KL reference when the config has
one), builds the optimizer, runs `ppo_update` once on
the batch (every mini-batch, forward + backward + AdamW step) and reports the update's seconds,
the process's peak RSS, and the tokens the forward computed. A pack's attention runs row by row
(learn/sparse_pack.py, the default under sdpa) or, in the "dense mask" variants, through the
pack's [N, N] tree mask (packing.PACK_ATTENTION = "dense"). Variants run in turn, the order
reversed every other repeat so that a shared machine's drift falls on all of them alike; the
table gives each variant's best time, its peak RSS, and both as ratios to the first variant
(today's path: padded rows, full logits). The "..." variants are the shipped path (packed +
shared, chunked) with one of its newer parts switched back (SWITCHED: the head's gradient through
autograd, its logits computed again in the backward, a pack's K and V copied per query head, its
attention under autocast in bf16); each
child also reports its update's seconds per phase (time/update/*).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {  # name: (optim overrides, attention implementation or None for the config's,
    #              a pack's attention: packing.PACK_ATTENTION, "auto" = row blocks under sdpa)
    "padded, full logits": ({"pack_rows": False, "logprob_chunk": 0}, None, "auto"),
    "padded, chunked": ({"pack_rows": False, "logprob_chunk": 512}, None, "auto"),
    "packed, chunked, dense mask": (
        {"pack_rows": True, "share_prefixes": False, "logprob_chunk": 512}, "sdpa", "dense"),
    "packed, chunked": ({"pack_rows": True, "share_prefixes": False, "logprob_chunk": 512}, "sdpa", "auto"),
    "packed + shared, chunked, dense mask": (
        {"pack_rows": True, "share_prefixes": True, "logprob_chunk": 512}, "sdpa", "dense"),
    "packed + shared, chunked": (
        {"pack_rows": True, "share_prefixes": True, "logprob_chunk": 512}, "sdpa", "auto"),
    "packed + shared, eager": (
        {"pack_rows": True, "share_prefixes": True, "logprob_chunk": 512}, "eager", "auto"),
}
SHARED = VARIANTS["packed + shared, chunked"]
# the shipped path (packed + shared, chunked) with one module switch put back to what it replaced
SWITCHED = {  # name: (module, attribute, value)
    "... head through autograd": ("tracetrain.learn.packing", "USE_HEAD_FUNCTION", False),
    "... logits recomputed": ("tracetrain.learn.head", "KEEP_LOGITS_MB", 0),
    "... K/V copied per head": ("tracetrain.learn.sparse_pack", "FOLD_GQA", False),
    "... attention in bf16": ("tracetrain.learn.sparse_pack", "WIDE_ATTENTION", False),
}
VARIANTS.update(dict.fromkeys(SWITCHED, SHARED))


def record(run: Path, out: Path) -> None:
    """The first step's rollouts of `run` -> (config, batch, advantages) saved to `out`."""
    import torch

    from tracetrain.run.step import build_rows
    from tracetrain.view.inspection import _open, _step_prefix, _tokenizer

    store, cfg = _open(run)
    done = [r for r in store.list_rollouts(limit=1_000_000)
            if r.state.terminal and "-eval" not in r.group_id]
    first = _step_prefix(done[0].group_id)
    step = [SimpleNamespace(rollout_id=r.rollout_id, state=r.state.value, reward=r.reward)
            for r in done if _step_prefix(r.group_id) == first]
    batch, adv, _ = build_rows(store, step, cfg, _tokenizer(cfg), version=0)
    store.close()
    torch.save({"config": cfg.model_dump_json(), "batch": batch, "advantages": adv}, out)
    print(f"saved {len(step)} rollouts, {batch.n_rows} rows, {int(batch.attention_mask.sum())} "
          f"real tokens, {int(batch.response_mask.sum())} trained, to {out}")


def child(path: str, variant: str, precision: str, threads: int, warmup: int = 0) -> None:
    import torch

    from tracetrain.config import TrainConfig
    from tracetrain.learn import packing
    from tracetrain.learn.optim import adamw
    from tracetrain.learn.update import ppo_update
    from tracetrain.models.load import load_policy
    from tracetrain.run.memory import peak_rss_gb

    torch.set_num_threads(threads)
    if variant in SWITCHED:
        import importlib

        module, name, value = SWITCHED[variant]
        setattr(importlib.import_module(module), name, value)
    saved = torch.load(path, weights_only=False)
    overrides, attn, packing.PACK_ATTENTION = VARIANTS[variant]
    data = json.loads(saved["config"])
    data["optim"].update(overrides)
    data["trainer"]["precision"] = precision
    if attn is not None:
        data["model"]["attn_implementation"] = attn
    cfg = TrainConfig.model_validate(data)
    model, _ = load_policy(cfg.model, seed=cfg.trainer.seed)
    optimizer = adamw(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    ref = copy.deepcopy(model) if cfg.loss.kl_coef else None  # the KL term's reference model
    loaded = peak_rss_gb()
    for _ in range(warmup):  # (kernels built, caches filled; the weights move on)
        ppo_update(model, optimizer, saved["batch"], saved["advantages"], cfg, ref_model=ref)
    t = time.perf_counter()
    results = ppo_update(model, optimizer, saved["batch"], saved["advantages"], cfg, ref_model=ref)
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "peak_gb": peak_rss_gb(), "loaded_gb": loaded,
                      "loss": sum(r.loss for r in results),
                      "computed": sum(r.metrics["tokens_computed"] for r in results),
                      "padded": sum(r.metrics["tokens_padded"] for r in results),
                      "phases": results[0].times}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", help="a run directory whose first step's rollouts make the batch")
    p.add_argument("--save", help="where to save that batch (with --run)")
    p.add_argument("--batch", help="a batch saved with --save")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--baseline", help="the variant the ratios are to (default: the first)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=0,
                   help="updates each child runs before the timed one (0: the first is timed)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.batch, a.child, a.precision, a.threads, a.warmup)
    if a.run:
        out = Path(a.save or Path(a.run) / "batch.pt")
        record(Path(a.run), out)
        if not a.batch:
            a.batch = str(out)
    if not a.batch:
        p.error("give --batch, or --run to record one")
    if a.repeats < 1:  # --repeats 0: only record the batch
        return
    from tracetrain.run.memory import peak_rss_gb  # noqa: F401  (fails early if the package is missing)

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"update on {a.batch}; {a.precision}, {a.threads} threads, {a.warmup} warm-up update(s); {cpu}")
    runs: dict[str, list[dict]] = {v: [] for v in a.variants}
    for k in range(a.repeats):
        for v in a.variants if k % 2 == 0 else a.variants[::-1]:
            done = subprocess.run([sys.executable, __file__, "--batch", a.batch, "--child", v,
                                   "--precision", a.precision, "--threads", str(a.threads),
                                   "--warmup", str(a.warmup)],
                                  capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                raise SystemExit(f"{v} failed:\n{done.stderr[-3000:]}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            runs[v].append(r)
            print(f"  {v:26s} {r['seconds']:7.1f} s  peak {r['peak_gb']:5.2f} GB  "
                  f"computed {r['computed']:.0f} of {r['padded']:.0f} padded  loss {r['loss']:+.6f}",
                  flush=True)
    base = a.baseline or a.variants[0]
    b_s = min(r["seconds"] for r in runs[base])
    b_m = max(r["peak_gb"] for r in runs[base])
    print(f"\n| variant | update s (best of {a.repeats}) | peak RSS GB | tokens computed | "
          f"time vs {base} | peak vs {base} |")
    print("|---|---|---|---|---|---|")
    for v in a.variants:
        s, m = min(r["seconds"] for r in runs[v]), max(r["peak_gb"] for r in runs[v])
        c = runs[v][0]
        print(f"| {v} | {s:.1f} | {m:.2f} | {c['computed']:.0f} / {c['padded']:.0f} | "
              f"{s / b_s:.2f}x | {m / b_m:.2f}x |")


if __name__ == "__main__":
    main()
