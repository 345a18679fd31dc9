"""A pack's attention alone, per layer (forward + backward), at SmolLM2-135M's heads: the dense
[N, N] tree mask through SDPA vs row by row (learn/sparse_pack.py) vs the same rows padded
(causal SDPA), on the packs the update builds from a recorded batch (bench_update.py --save).

    .venv/bin/python bench/bench_pack_attention.py --batch runs/calc-batch/batch.pt

Random q, k, v of the model's shapes (9 query heads, 3 kv heads, head dim 64, fp32, 1 thread);
the three interleaved `--repeats` times, each the mean of 5 forward + backward passes; the table
gives each one's best and its ratio to padded.
"""

from __future__ import annotations

import argparse
import time

import torch

from tracetrain.learn.packing import pack_rows
from tracetrain.learn.sparse_pack import build_plan, pack_attention

H, HKV, D = 9, 3, 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    b = torch.load(a.batch, weights_only=False)["batch"]
    # the packs of one micro-batch as the planner cuts them at 4 x hidden = 2,304 tokens:
    # 12 rows without sharing (~1,900 tokens), 16 rows with it (the update's mini-batch)
    print("| pack | N | scores: dense / row blocks / padded | dense ms | row blocks ms | padded ms | "
          "dense / padded | row blocks / padded |")
    print("|---|---|---|---|---|---|---|---|")
    for share, n in ((False, 12), (True, 16)):
        measure(b, share, n, a.repeats)


def measure(b, share: bool, n: int, repeats: int) -> None:
    """One table line: the first n rows of batch b as one pack (shared prefixes or not)."""
    ids, att = b.input_ids[:n], b.attention_mask[:n]
    pk = pack_rows(ids, att, share=share)
    plan = build_plan(pk.node, pk.n_tokens)
    N, W = pk.n_tokens, int(att.sum(1).max())
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, N, D, generator=g, requires_grad=True)
    k = torch.randn(1, HKV, N, D, generator=g, requires_grad=True)
    v = torch.randn(1, HKV, N, D, generator=g, requires_grad=True)
    qp = torch.randn(n, H, W, D, generator=g, requires_grad=True)
    kp = torch.randn(n, H, W, D, generator=g, requires_grad=True)
    mask = pk.allowed[None, None]

    def rep(t):  # kv heads repeated for the dense call, as transformers' repeat_kv does
        return t[:, :, None].expand(1, HKV, H // HKV, N, D).reshape(1, H, N, D)

    fns = {
        "dense": lambda: torch.nn.functional.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask),
        "rows": lambda: pack_attention(q, k, v, plan),
        "padded": lambda: torch.nn.functional.scaled_dot_product_attention(qp, kp, kp, is_causal=True),
    }
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t = time.perf_counter()
            for _ in range(5):
                f().sum().backward()
            best[name] = min(best[name], (time.perf_counter() - t) / 5)
    print(f"| {n} rows, {'shared prefixes' if share else 'no sharing'} | {N} | "
          f"{N * N:,} / {plan.scores:,} / {n * W * W:,} | {best['dense'] * 1e3:.0f} | "
          f"{best['rows'] * 1e3:.0f} | {best['padded'] * 1e3:.0f} | "
          f"{best['dense'] / best['padded']:.2f}x | {best['rows'] / best['padded']:.2f}x |")

if __name__ == "__main__":
    main()
