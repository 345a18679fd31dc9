"""Token weights + policy loss on [N, 2048] float32, ~2.5 rows per rollout, N in {1024, 4096, 16384}.

Times, per size (min, or --stat median, of --repeat runs after one warm-up, the candidates of a size
interleaved run by run; min is the least disturbed run, which matters on a shared machine):
  row_scales        tracetrain.objective.weights.row_scales(mask, rollout_index)          -> [N]
  row_scales(str)   the same with rollout ids as a list of str
  token_weights     mask * row_scales, materialized [N, 2048]
  AL normalize      Agent Lightning 1.0.2 normalize_advantages_by_rollout (in bench/.venv-peers,
                    a subprocess on the same inputs), with AL / row_scales
  loss              row_scales + policy_loss (PPO dual-clip surrogate, k3 KL to a reference,
                    entropy term) + backward w.r.t. the logprobs
  fused             (logprobs * advantages * mask).sum().backward(), with loss / fused
  ... (row adv)     the same two with advantages given per row ([N], broadcast) instead of [N, 2048]
  --compare FILE    another loss.py (e.g. the commit before a change), timed in the same runs:
                    its row_scales and both losses, and this tree's time over its (new/old); a
                    file named loss_cpu*.py: this tree's loss.py on that loss_cpu

Goals (issues 3 and 18): row_scales >= 3x faster than AL at every size; loss within 3x of fused.

    .venv/bin/python bench/bench_loss.py [--sizes 1024 4096 16384] [--repeat 5] [--threads N]
                                         [--stat min|median] [--no-peer] [--compare FILE]
    git show HEAD~1:tracetrain/objective/loss.py > /tmp/loss_old.py   # then --compare /tmp/loss_old.py
    git show HEAD~1:tracetrain/objective/loss_cpu.py > /tmp/loss_cpu_old.py  # the CPU paths alone
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
PEERS_PY = ROOT / "bench" / ".venv-peers" / "bin" / "python"
R = 2048


def make_inputs(n: int, seed: int = 0) -> dict:
    """Rows of rollouts with 2 or 3 rows each (2.5 on average); each row's mask covers a random
    response length with ~10% observation tokens (mask 0) inside it."""
    g = torch.Generator().manual_seed(seed)
    sizes = [2 if k % 2 == 0 else 3 for k in range(n)]
    counts, total = [], 0
    for s in sizes:
        s = min(s, n - total)
        counts.append(s)
        total += s
        if total == n:
            break
    rollout_index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    lengths = torch.randint(1, R + 1, (n, 1), generator=g)
    mask = (torch.arange(R) < lengths) & (torch.rand(n, R, generator=g) > 0.1)
    adv_rollout = torch.randn(len(counts), generator=g)
    advantages = adv_rollout[rollout_index][:, None] * mask  # [N, R], as a peer stores them
    return {
        "mask": mask,
        "rollout_index": rollout_index,
        "rollout_ids": [f"rollout-{k}" for k in rollout_index.tolist()],
        "advantages": advantages,
        "adv_row": adv_rollout[rollout_index],
    }


STAT = {"min": min, "median": statistics.median}
stat, STAT_NAME = min, "min"


def timeit(fn, repeat: int) -> float:
    """Wall time in ms over `repeat` runs (min or median), after one warm-up run."""
    return time_all({"fn": fn}, repeat)["fn"]


def time_all(fns: dict, repeat: int) -> dict:
    """{name: wall time in ms} (min or median of `repeat` runs after one warm-up), the functions
    interleaved run by run so that a disturbance of the machine hits them alike."""
    times: dict = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * stat(v) for k, v in times.items()}


def loss_api(loss_module, weights_module) -> SimpleNamespace:
    """What the benchmark calls: a loss module's policy_loss and a weights module's row_scales,
    with this tree's RowWeights (the class every loss.py here imports)."""
    from tracetrain.objective.weights import RowWeights

    return SimpleNamespace(policy_loss=loss_module.policy_loss, RowWeights=RowWeights,
                           row_scales=weights_module.row_scales)


def load_loss(path: str):
    """A loss.py file as a module of its own (to time it next to this tree's); a loss_cpu.py file:
    this tree's loss.py and weights.py on that loss_cpu (the CPU paths of another commit)."""
    def load(name: str, file: str):
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    if Path(path).name.startswith("loss_cpu"):
        from tracetrain.objective import loss, weights

        other_cpu = load("loss_cpu_compared", path)
        compared_loss = load("loss_compared", loss.__file__)
        compared_weights = load("weights_compared", weights.__file__)
        compared_loss.loss_cpu = compared_weights.loss_cpu = other_cpu
        return loss_api(compared_loss, compared_weights)
    import tracetrain
    from tracetrain.objective import loss_cpu

    tracetrain.loss_cpu = loss_cpu  # where a loss.py from before the stage folders imports it
    module = load("loss_compared", path)
    if hasattr(module, "row_scales"):  # a loss.py from before weights.py was split off
        return module
    from tracetrain.objective import weights

    return loss_api(module, weights)


def peer_main(n: int, repeat: int, threads: int | None) -> None:
    """Run inside bench/.venv-peers: time Agent Lightning's function on the same inputs."""
    if threads:
        torch.set_num_threads(threads)
    from agentlightning.verl.per_rollout_loss import normalize_advantages_by_rollout

    x = make_inputs(n)

    def al():
        normalize_advantages_by_rollout(
            x["advantages"], x["mask"], x["rollout_ids"], num_trained_rows=n
        )

    print(json.dumps({"al_ms": timeit(al, repeat)}))


def time_peer(n: int, repeat: int, threads: int | None) -> float | None:
    if not PEERS_PY.exists():
        return None
    cmd = [str(PEERS_PY), __file__, "--peer", str(n), "--repeat", str(repeat), "--stat", STAT_NAME]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)["al_ms"]
    print(f"  (peer run failed: {out.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
    return None


def bench_size(n: int, repeat: int, other=None) -> dict:
    """tracetrain's timings at one size (ms); with `other` (a loss module), its timings too."""
    from tracetrain.objective import loss, weights

    here = loss_api(loss, weights)
    x = make_inputs(n)
    g = torch.Generator().manual_seed(1)
    mask, ri, adv_tok, adv_row = x["mask"], x["rollout_index"], x["advantages"], x["adv_row"]
    logprobs = (-3 * torch.rand(n, R, generator=g)).requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(n, R, generator=g)
    ref = logprobs.detach() + 0.1 * torch.randn(n, R, generator=g)
    entropy = 2 * torch.rand(n, R, generator=g)

    def loss_pass(adv, mod=here):
        logprobs.grad = None
        value, _ = mod.policy_loss(
            logprobs,
            old,
            adv,
            mod.RowWeights(mask, mod.row_scales(mask, ri)),
            ref_logprobs=ref,
            kl_coef=0.01,
            entropy=entropy,
            entropy_coef=0.01,
        )
        value.backward()

    def fused_pass(adv):
        logprobs.grad = None
        (logprobs * adv * mask).sum().backward()

    fns = {
        "row_scales": lambda: weights.row_scales(mask, ri),
        "row_scales_str": lambda: weights.row_scales(mask, x["rollout_ids"]),
        "token_weights": lambda: weights.token_weights(mask, ri),
        "loss": lambda: loss_pass(adv_tok),
        "fused": lambda: fused_pass(adv_tok),
        "loss_row": lambda: loss_pass(adv_row),
        "fused_row": lambda: fused_pass(adv_row[:, None]),
    }
    if other is not None:
        fns["old_row_scales"] = lambda: other.row_scales(mask, ri)
        fns["old_loss"] = lambda: loss_pass(adv_tok, other)
        fns["old_loss_row"] = lambda: loss_pass(adv_row, other)
    return {"rollouts": int(ri[-1]) + 1, **time_all(fns, repeat)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--stat", choices=sorted(STAT), default="min")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--compare", default=None,
                   help="another loss.py (or loss_cpu.py) to time side by side")
    p.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    global stat, STAT_NAME
    stat, STAT_NAME = STAT[a.stat], a.stat
    if a.peer is not None:
        return peer_main(a.peer, a.repeat, a.threads)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, R = {R}, float32, "
        f"{a.stat} of {a.repeat} runs (ms)"
    )
    have_peer = PEERS_PY.exists() and not a.no_peer
    if a.no_peer:
        print("Agent Lightning peer: skipped (--no-peer); tracetrain figures only")
    elif not have_peer:
        print("Agent Lightning peer: unavailable (no bench/.venv-peers); tracetrain figures only")
    other = load_loss(a.compare) if a.compare else None
    head = (
        f"{'N':>6} {'rollouts':>8} | {'row_scales':>10} {'(str ids)':>9} {'token_w':>8} | "
        f"{'AL norm':>8} {'AL/rs':>6} | {'loss':>8} {'fused':>8} {'ratio':>6} | "
        f"{'loss':>8} {'fused':>8} {'ratio':>6} (row adv)"
    )
    if other is not None:
        print(f"compared: {a.compare} (old); new/old = this tree's time over its")
        head += f" | {'old rs':>7} {'new/old':>7} {'old loss':>8} {'new/old':>7} {'(row)':>8} {'new/old':>7}"
    print(head)
    print("-" * len(head))
    for n in a.sizes:
        t = bench_size(n, a.repeat, other)
        t_al = time_peer(n, a.repeat, a.threads) if have_peer else None
        rs = t["row_scales"]
        al = f"{t_al:8.1f} {t_al / rs:5.1f}x" if t_al is not None else f"{'n/a':>8} {'':>6}"
        print(
            f"{n:>6} {t['rollouts']:>8} | {rs:10.2f} {t['row_scales_str']:9.2f} "
            f"{t['token_weights']:8.1f} | {al} | "
            f"{t['loss']:8.1f} {t['fused']:8.1f} {t['loss'] / t['fused']:5.2f}x | "
            f"{t['loss_row']:8.1f} {t['fused_row']:8.1f} {t['loss_row'] / t['fused_row']:5.2f}x"
            + (
                ""
                if other is None
                else f" | {t['old_row_scales']:7.2f} {rs / t['old_row_scales']:6.2f}x "
                f"{t['old_loss']:8.1f} {t['loss'] / t['old_loss']:6.2f}x "
                f"{t['old_loss_row']:8.1f} {t['loss_row'] / t['old_loss_row']:6.2f}x"
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
