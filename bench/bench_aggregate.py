"""Benchmark: turns -> rows for 512 rollouts x 8 turns, tracetrain.rows.aggregate vs Agent Lightning.

Data (seeded): turn 0's prompt is 64 tokens; every turn answers with 128 tokens (with logprobs);
the prompt of turn k is the previous context (prompt + response) + 64 observation tokens. The
"breaks" variant changes one context token before 20% of all turns (never a first turn; about
half in an earlier response, half in an earlier prompt), so the trajectory level must close rows
there.

Peer: Agent Lightning 1.0.2 `RolloutAdapter.get_train_data_batch` (agentlightning/verl/
rollout_adapter.py), fed the same token ids as `CompletedRollout`/`Triplet`s, run with the
interpreter of the peers env (bench/.venv-peers, see bench/setup_peers.sh) when it exists.

Each (case, implementation) runs in a fresh child process: build inputs, a warm-up call on 16
rollouts, gc, then baseline = current RSS and the peak counter is reset (/proc/self/clear_refs);
the first timed call gives the peak RSS above baseline (the output is inspected only after it);
wall time is the best of --repeat calls (the best, because the machine is shared and other work
only ever adds time). Both sides run with the same
number of torch/OpenMP threads (--threads, default 1: on a small shared machine, idle-waiting
OpenMP workers make multi-threaded timings erratic).

Limits (--limits): `exact` = the exact maxima of each case's rows, so both sides build tensors of
the same shape (the strict like-for-like comparison); `2048` = max_prompt_length =
max_response_length = 2048, a typical config: the peer always pads to the limits, tracetrain pads to
the batch maxima (its default). Nothing is dropped or truncated in either.

Two tracetrain rows: `tracetrain` gets turns whose ids and logprobs are Python lists (what a
user builds by hand); `tracetrain-store` gets the same turns in the form the trainer reads them
from its store (`SQLiteStore.training_turns`: ids as array('i'), logprobs as array('f'), the
stored bytes), which aggregate copies as memory. The peer gets lists, its own form.

Floor (row 'floor', --no-floor to skip): `touch_floor` does only the work tracetrain's method
cannot avoid on these Python-list inputs (compare every prompt with the previous context, read
each chain's last ids and every logprob once, write the outputs once), so peer / floor is the
most any implementation of that method could reach on this machine at that moment.

    .venv/bin/python bench/bench_aggregate.py [--repeat 5] [--limits exact 2048] [--only CASE ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / "bench" / ".venv-peers" / "bin" / "python"

N_ROLLOUTS, N_TURNS, FIRST_PROMPT, OBS, RESPONSE, VOCAB = 512, 8, 64, 64, 128, 32_000
BREAK_FRACTION = 0.2
CASES = {  # name: (level, breaks)
    "trajectory-clean": ("trajectory", False),
    "trajectory-breaks": ("trajectory", True),
    "transition-clean": ("transition", False),
    "transition-breaks": ("transition", True),
}


# ---------------------------------------------------------------- data


def make_traces(breaks: bool, seed: int = 0, n_rollouts: int = N_ROLLOUTS):
    """[(rollout_id, reward, [(prompt_ids, response_ids, logprobs)])], plain lists."""
    rng = random.Random(seed)
    eligible = [(i, k) for i in range(n_rollouts) for k in range(1, N_TURNS)]  # never a first turn
    n_break = round(BREAK_FRACTION * n_rollouts * N_TURNS) if breaks else 0
    broken = set(rng.sample(eligible, n_break))
    traces = []
    for i in range(n_rollouts):
        prompt = [rng.randrange(VOCAB) for _ in range(FIRST_PROMPT)]
        resp_spans: list[tuple[int, int]] = []
        turns = []
        for k in range(N_TURNS):
            response = [rng.randrange(VOCAB) for _ in range(RESPONSE)]
            logprobs = [-rng.random() * 4 for _ in range(RESPONSE)]
            turns.append((prompt, response, logprobs))
            resp_spans.append((len(prompt), len(prompt) + RESPONSE))
            context = prompt + response
            if (i, k + 1) in broken:  # one token of the context changes: a response or a prompt
                a, b = rng.choice(resp_spans)
                p = (
                    rng.randrange(a, b)
                    if rng.random() < 0.5
                    else rng.randrange(0, resp_spans[0][0])
                )
                context = context[:p] + [(context[p] + 1) % VOCAB] + context[p + 1 :]
            prompt = context + [rng.randrange(VOCAB) for _ in range(OBS)]
        traces.append((f"rollout-{i}", float(rng.random() < 0.5), turns))
    return traces


def to_tracetrain(traces):
    from tracetrain.types import Rollout, Turn

    return [
        Rollout(
            rid, f"group-{n // 8}", [Turn(p, r, lp, model_version=1) for p, r, lp in turns], reward
        )
        for n, (rid, reward, turns) in enumerate(traces)
    ]


def to_tracetrain_arrays(traces):
    """The same rollouts in the form the trainer gets them from the store
    (`SQLiteStore.training_turns`): ids as array('i'), logprobs as array('f')."""
    from array import array

    from tracetrain.types import Rollout, Turn

    return [
        Rollout(
            rid,
            f"group-{n // 8}",
            [Turn(array("i", p), array("i", r), array("f", lp), model_version=1) for p, r, lp in turns],
            reward,
        )
        for n, (rid, reward, turns) in enumerate(traces)
    ]


def to_agentlightning(traces):
    """Fresh CompletedRollouts (the adapter extends a logprob list in place: never reuse them)."""
    from agentlightning.verl.agl_rollout_manager import CompletedRollout, Triplet

    return [
        CompletedRollout(
            rollout_id=rid,
            data_id=f"group-{n // 8}",
            step=0,
            sample_idx_in_step=n,
            enqueue_time=0.0,
            final_reward=reward,
            triplets=[
                Triplet(prompt={"token_ids": p}, response={"token_ids": r, "log_probs": list(lp)})
                for p, r, lp in turns
            ],
        )
        for n, (rid, reward, turns) in enumerate(traces)
    ]


def limits(traces, level):
    """Exact prompt/response widths of the rows of `level`, worked out from the traces alone."""
    if level == "transition":
        return max(len(p) for _, _, ts in traces for p, _, _ in ts), RESPONSE
    max_p = max_r = 0
    for _, _, turns in traces:
        first = 0  # a row starts at turn 0 and at every turn whose prompt breaks the prefix
        for k, (p, r, _) in enumerate(turns):
            prev = turns[k - 1][0] + turns[k - 1][1] if k else None
            if k and p[: len(prev)] != prev:
                first = k
            max_p = max(max_p, len(turns[first][0]))
            max_r = max(max_r, len(p) + len(r) - len(turns[first][0]))
    return max_p, max_r


def touch_floor(rollouts, level: str, width_p: int, width_r: int) -> SimpleNamespace:
    """The Python-object and memory work tracetrain's method cannot avoid, and nothing else.

    1. Compare every prompt with the previous context (list slice compares): this decides the
       rows of the trajectory level, and the chains that let either level read a token once.
    2. Read every token id of each chain's last context, and every logprob, once into arrays
       (struct.pack_into, the cheapest bulk list -> array copy in the standard library).
    3. Write the output tensors once (3 x int64 [rows, P+R], bool and float32 [rows, R]).
    Returns the outputs, rows and trained tokens. Assumes no length splits (true here).
    """
    import struct

    import numpy as np

    n_rows = n_ids = n_lps = 0
    ends, lps = [], []
    for r in rollouts:
        turns, prev_extends = r.turns, False
        for k, t in enumerate(turns):
            nxt = turns[k + 1].prompt_ids if k + 1 < len(turns) else None
            lp, lr = len(t.prompt_ids), len(t.response_ids)
            extends = (
                nxt is not None and nxt[lp : lp + lr] == t.response_ids and nxt[:lp] == t.prompt_ids
            )
            if not extends:  # t ends a chain
                ends.append(t)
                n_ids += lp + lr
            n_rows += level == "transition" or k == 0 or not prev_extends
            prev_extends = extends
            lps.append(t.response_logprobs)
            n_lps += lr
    ids, at = np.empty(n_ids, dtype=np.int64), 0
    for t in ends:
        for part in (t.prompt_ids, t.response_ids):
            struct.pack_into(f"{len(part)}q", ids, 8 * at, *part)
            at += len(part)
    values, at = np.empty(n_lps, dtype=np.float32), 0
    for part in lps:
        struct.pack_into(f"{len(part)}f", values, 4 * at, *part)
        at += len(part)
    width = width_p + width_r
    outputs = [np.full((n_rows, width), 1, dtype=np.int64) for _ in range(3)]
    outputs += [np.ones((n_rows, width_r), dtype=np.bool_)]
    outputs += [np.full((n_rows, width_r), -1.0, dtype=np.float32)]
    return SimpleNamespace(outputs=outputs, rows=n_rows, trained=at)


# ---------------------------------------------------------------- one measured run (child)


def _status(key: str) -> int:
    return (
        int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    )


def _tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if type(obj).__name__ == "ndarray":  # the floor's numpy outputs
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if hasattr(obj, "batch"):  # verl DataProto -> TensorDict
        return sum(_tensor_bytes(v) for v in obj.batch.values())
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(v) for v in vars(obj).values())
    return 0


def child(case: str, impl: str, limit_mode: str, repeat: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    level, breaks = CASES[case]
    traces = make_traces(breaks)
    max_p, max_r = (
        limits(traces, level) if limit_mode == "exact" else (int(limit_mode), int(limit_mode))
    )
    if impl in ("tracetrain", "tracetrain-store"):
        from tracetrain.rows.aggregate import aggregate

        convert = to_tracetrain if impl == "tracetrain" else to_tracetrain_arrays

        def prepare():
            return convert(traces)

        def call(inputs):
            batch, m = aggregate(
                inputs, level=level, max_prompt_length=max_p, max_response_length=max_r
            )
            assert m["n_rollouts"] == len(inputs) and m["truncated/rows"] == 0
            return batch

        def count(batch):  # rows and trained tokens (after the measurement)
            return batch.n_rows, int(batch.response_mask.sum())

        tiny = convert(traces[:16])
    elif impl == "floor":
        width_p, width_r = limits(traces, level)  # the batch widths, whatever the limits

        def prepare():
            return to_tracetrain(traces)

        def call(inputs):
            return touch_floor(inputs, level, width_p, width_r)

        def count(out):
            return out.rows, out.trained

        tiny = to_tracetrain(traces[:16])
    else:
        from agentlightning.verl.rollout_adapter import RolloutAdapter

        adapter = RolloutAdapter(
            max_prompt_length=max_p,
            max_response_length=max_r,
            device=torch.device("cpu"),
            pad_token_id=0,
            trace_aggregator_level=level,
        )

        def prepare():
            return to_agentlightning(traces)

        def call(inputs):
            return adapter.get_train_data_batch(inputs)[0]

        def count(out):
            b = out.batch
            mask = (
                b["response_mask"]
                if "response_mask" in b.keys()
                else b["attention_mask"][:, max_p:]
            )
            return len(b["input_ids"]), int(mask.sum())

        tiny = to_agentlightning(traces[:16])

    call(tiny)  # warm-up (16 rollouts): thread pools, first-call library work
    del tiny
    times, first = [], None
    for _ in range(repeat):
        inputs = prepare()
        gc.collect()
        base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to now
        t0 = time.perf_counter()
        out = call(inputs)
        times.append(time.perf_counter() - t0)
        if first is None:
            first = dict(peak_above=_status("VmHWM") - base, out_bytes=_tensor_bytes(out))
            first["rows"], first["trained"] = count(out)
        del out, inputs
    return dict(
        case=case, impl=impl, wall=min(times), walls=times, limits=f"{max_p}/{max_r}", **first
    )


# ---------------------------------------------------------------- driver (parent)


def run_child(
    python, case: str, impl: str, limit_mode: str, repeat: int, threads: int
) -> dict | None:
    cmd = [str(python), __file__, "--child", case, impl, limit_mode]
    cmd += ["--repeat", str(repeat), "--threads", str(threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(
            f"  {impl} on {case} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}",
            file=sys.stderr,
        )
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def peer_available() -> bool:
    if not PEER_PYTHON.exists():
        return False
    probe = [str(PEER_PYTHON), "-c", "import agentlightning.verl.rollout_adapter, tracetrain"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--repeat", type=int, default=5, help="timed calls per case (best and median are reported)"
    )
    ap.add_argument("--only", nargs="*", choices=list(CASES), default=list(CASES))
    ap.add_argument("--limits", nargs="*", choices=["exact", "2048"], default=["exact", "2048"])
    ap.add_argument(
        "--threads", type=int, default=1, help="torch/OpenMP threads, same for both sides"
    )
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument(
        "--no-floor", action="store_true", help="skip the 'floor' row (touch_floor's work alone)"
    )
    ap.add_argument("--child", nargs=3, metavar=("CASE", "IMPL", "LIMITS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args.repeat, args.threads)), flush=True)
        return

    peer = not args.no_peer and peer_available()
    print(f"{N_ROLLOUTS} rollouts x {N_TURNS} turns; prompt_k = context + {OBS} obs tokens,")
    print(
        f"{RESPONSE} response tokens; breaks: {BREAK_FRACTION:.0%} of turns change a context token."
    )
    print(f"Best and median of {args.repeat} calls; peak RSS above baseline on the first call in")
    print(
        f"a fresh process; 'out' = output tensor bytes; torch/OpenMP threads: {args.threads} on all"
    )
    print("sides. speed-up = peer / tracetrain (best, median); on the 'floor' row, peer / floor:")
    print("the most any implementation that does touch_floor's work could reach.")
    if args.no_peer:
        print("peer: skipped (--no-peer): tracetrain figures only")
    elif not peer:
        print(f"peer: Agent Lightning unavailable ({PEER_PYTHON} missing or broken;")
        print("bench/setup_peers.sh builds it): tracetrain figures only")
    head = f"{'case':<18} {'limits':<10} {'impl':<16} {'rows':>5} {'best s':>7} {'med s':>7}"
    head += f" {'rows/s':>8} {'peak MB':>8} {'out MB':>7} {'peak/out':>8} {'speed-up':>13}"
    print("\n" + head)
    for mode in args.limits:
        for case in args.only:
            ours = run_child(sys.executable, case, "tracetrain", mode, args.repeat, args.threads)
            theirs = (
                run_child(PEER_PYTHON, case, "agentlightning", mode, args.repeat, args.threads)
                if peer
                else None
            )
            floor = (
                None
                if args.no_floor
                else run_child(sys.executable, case, "floor", mode, args.repeat, args.threads)
            )
            stored = run_child(sys.executable, case, "tracetrain-store", mode, args.repeat, args.threads)
            for r in (ours, stored, theirs, floor):
                if r is None:
                    continue
                mb, ratio, med = 2**20, r["peak_above"] / r["out_bytes"], median(r["walls"])
                line = f"{case:<18} {r['limits']:<10} {r['impl']:<16} {r['rows']:>5} "
                line += f"{r['wall']:>7.3f} {med:>7.3f} {r['rows'] / r['wall']:>8.0f} "
                line += f"{r['peak_above'] / mb:>8.1f} {r['out_bytes'] / mb:>7.1f} {ratio:>8.2f}"
                if r is not theirs and theirs is not None:
                    best_x, med_x = theirs["wall"] / r["wall"], median(theirs["walls"]) / med
                    line += f" {best_x:>5.1f}x {med_x:>5.1f}x"
                    if (r["rows"], r["trained"]) != (theirs["rows"], theirs["trained"]):
                        line += (
                            f"  (MISMATCH: peer rows {theirs['rows']}, trained {theirs['trained']})"
                        )
                print(line, flush=True)


if __name__ == "__main__":
    main()
