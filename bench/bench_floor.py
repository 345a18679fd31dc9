"""The floor of a GRPO step on this CPU: its matmul rate at the model's shapes, the least time each
phase's arithmetic needs at that rate, and one real tracetrain step's breakdown beside it (issue 46).

    .venv/bin/python bench/bench_floor.py                # SmolLM2-135M, 4 questions x 8 x 32 tokens
    .venv/bin/python bench/bench_floor.py --json         # the same figures as one JSON object

The step is bench/bench_grpo_smollm2.py's (its config, its Trainer, bench_train_step's `serving`
and `Stepper`: one step of the run loop, collect -> rows -> update -> sync):
the calculator's prompts, --prompts questions x 8 rollouts x exactly --new-tokens new tokens,
trainer.precision auto; one warm-up step, then one timed step.

Counting (the shapes are read from the loaded model's config: h hidden, I intermediate, L layers,
H heads, K kv heads, d head dim, V vocab; q = H*d, kv = K*d; 2 FLOPs per multiply-add):
    P_layer = h*q + 2*h*kv + q*h + 3*h*I       (q, k, v, o projections; gate, up, down)
    P_head  = h*V                              (the lm head, tied to the embeddings in SmolLM2)
    F(T, G, A) = 2*L*P_layer*T + 2*P_head*G + 4*L*q*A
is one forward pass over T tokens that needs logits at G positions, its tokens attending to A keys
in all (a token at position p attends p + 1 keys, itself included; q.k and p.v cost 2*d each per
head and key). Norms, rotary, softmax, activations and the embedding lookup are not counted (O(h)
per token). The step's work is taken from the requests the engine decoded (prompt p_r, n_r new
tokens, r = 1..R; one-turn rollouts, so one row each):
    prefill  F(T, G, A), T = the nodes of the prompts' prefix tree (each shared prefix once),
             A = the sum of the nodes' depths, G = the distinct prompts (one logit row each)
    decode   F(T, T, A), T = sum_r (n_r - 1): the first token is sampled from the prefill's logits
             and the last is never forwarded (4 x 8 x 32: 31 forwards of 32 rows);
             A = sum_r sum_{i=1..n_r-1} (|p_r| + i), the attention over each row's KV cache
    update   3 * F(T, G, A) (forward, then the backward's input and weight gradients, one forward's
             FLOPs each) over the prefix tree of the rows (prompt + response less its last token,
             each shared prefix once: what packing with shared prefixes computes at best);
             G = sum_r n_r, the trained tokens (the lm head runs only where a token is trained)
and each phase's floor is its FLOPs at the rate measured here at its shapes:
    floor = 2*L*P_layer*T / rate_layers(M) + 2*P_head*G / rate_head(G) + 4*L*q*A / rate_layers(M)
(times 3 for the update, each rate then that of the three products). rate_layers(M): the model's
own projection weights in order times x[M, in] (F.linear, as nn.Linear; for the update also dy @ W
and dy.T @ x), over all L layers for M <= 128 (small batches stream the weights from memory, as a
decode step does), else over the first layers that make a 1 GFLOP pass; M = the batch (decode), the
prefill tree's tokens, the update tree's tokens. rate_head: the lm head's first rows (a slice of the
vocabulary, at least 512 rows, as many as make a 1 GFLOP pass) at G rows. Each rate is the best of
--repeats short passes: on a busy machine, the quiet windows (a floor is what the CPU allows, not
what it gave the step). Attention is
counted at the layers' rate: a lower bound (its small batched products run slower). The engine
computes in the precision engine.precision chose (--engine-precision, auto by default: fp32 or
bf16), the update in the one trainer.precision auto chose (fp32 or bf16-mixed): each phase's
ratio is to the floor at its precision; the bf16 column is what bf16 would allow, measured where the
CPU has bf16 units (lscpu flags avx512_bf16 or amx_bf16). Sampling, the gateway, the store, rows and
sync do no matmul: no floor.

The step's breakdown (its parts add up to the step):
    prefill, decode, sampling   the engine's stats prefill_s, decode_forward_s, sample_s (sampling:
                                the draw, logprobs and each row's bookkeeping and stop checks)
    engine other                the engine's decode loops' seconds less those three (masks, cache
                                trims, threads)
    gateway + agents            time/collect_s less the engine's loops (runner, agents, HTTP gateway,
                                turn records, batching windows)
    store reads                 build_rows' reads (load_rollouts, turn_contexts)
    rows                        time/rows_s less those reads (aggregation, advantages)
    update, sync                time/update_s, time/sync_s (0 when the engine shares the module)
    rest                        the step less all that (pause and drain around the update, version)
and, beside them (not in the sum: the writer thread runs during the collect), the store's group
commits' seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

BUDGET_FLOPS = 1e9  # a timed pass's FLOPs, short enough for a quiet window on a busy machine
STREAMED = 128  # up to this many rows, rate_layers passes over all the layers' weights


# ------------------------------------------------------------------ counting
@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> Shapes:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers, heads,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim, config.vocab_size)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return h * self.q + 2 * h * kv + self.q * h + 3 * h * self.intermediate

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab


def forward_flops(s: Shapes, tokens: int, logits: int, keys: int) -> dict[str, int]:
    """F(T, G, A) of the docstring, by part: layers, head, attention."""
    return {"layers": 2 * s.layers * s.layer_params * tokens, "head": 2 * s.head_params * logits,
            "attention": 4 * s.layers * s.q * keys}


def prefix_tree(seqs: list[list[int]]) -> tuple[int, int]:
    """(nodes, sum of depths) of the prefix tree of `seqs`: each shared prefix counted once."""
    seen: set[tuple[int, ...]] = set()
    for seq in seqs:
        for k in range(1, len(seq) + 1):
            seen.add(tuple(seq[:k]))
    return len(seen), sum(len(p) for p in seen)


def step_work(s: Shapes, requests: list[tuple[list[int], list[int]]]) -> dict[str, dict]:
    """The step's phases' work from its requests [(prompt ids, response ids)]: {phase: {"M": the
    rows of its matmuls, "G": the lm head's rows, "flops": by part, "tokens"}} (see the docstring)."""
    prompts = [p for p, _ in requests]
    t, a = prefix_tree(prompts)
    g = len({tuple(p) for p in prompts})
    out = {"prefill": {"M": t, "G": g, "tokens": t, "flops": forward_flops(s, t, g, a)}}
    t = sum(len(r) - 1 for _, r in requests)
    a = sum(len(p) + i for p, r in requests for i in range(1, len(r)))
    out["decode"] = {"M": len(requests), "G": len(requests), "tokens": t, "flops": forward_flops(s, t, t, a)}
    t, a = prefix_tree([p + r[:-1] for p, r in requests])
    g = sum(len(r) for _, r in requests)
    out["update"] = {"M": t, "G": g, "tokens": t,
                     "flops": {k: 3 * v for k, v in forward_flops(s, t, g, a).items()}}
    return out


# ------------------------------------------------------------------ rates
def bf16_units() -> list[str]:
    """The CPU's bf16 matrix flags (lscpu's, from /proc/cpuinfo)."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except (OSError, subprocess.SubprocessError, StopIteration):
        return "unknown"


def layer_weights(model) -> list[list]:
    """Per decoder layer, its Linear weights [out, in] in module order."""
    import torch

    return [[m.weight for m in layer.modules() if isinstance(m, torch.nn.Linear)]
            for layer in model.model.layers]


def matmul_rate(weights: list, M: int, dtype, *, backward: bool, repeats: int,
                products: str | None = None) -> float:
    """GFLOP/s over `weights` (each used once per pass) of `products`: "forward" x[M, in] @ W.T,
    "backward" dy @ W and dy.T @ x (the input and weight gradients), "both" all three (default:
    "both" with `backward`, else "forward"); best of `repeats` passes after one warm-up."""
    import torch

    products = products or ("both" if backward else "forward")
    linear = torch.nn.functional.linear  # what nn.Linear calls
    ws = [w.detach().to(dtype) for w in weights]
    flops = 2 * M * sum(w.numel() for w in ws) * {"forward": 1, "backward": 2, "both": 3}[products]
    xs = {n: torch.randn(M, n, dtype=dtype) for w in ws for n in w.shape}
    best = float("inf")
    with torch.no_grad():
        for k in range(repeats + 1):
            t = time.perf_counter()
            for w in ws:
                y = linear(xs[w.shape[1]], w) if products != "backward" else None
                if products != "forward":
                    dy = xs[w.shape[0]]
                    y = dy @ w, dy.T @ xs[w.shape[1]]
            del y
            if k:
                best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


def bandwidth_gbs(repeats: int, mib: int = 256) -> float:
    """GB/s of a copy between two float32 buffers of `mib` MiB (bytes read + bytes written),
    best of `repeats`: the rate a pass that streams every parameter's state runs at, at best."""
    import torch

    a, b = torch.randn(mib * 2**18), torch.empty(mib * 2**18)
    best = float("inf")
    for k in range(repeats + 1):
        t = time.perf_counter()
        b.copy_(a)
        if k:
            best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9


def phase_rates(model, s: Shapes, work: dict, dtype, repeats: int) -> dict[str, dict[str, float]]:
    """{phase: {"layers": GFLOP/s at its M, "head": GFLOP/s at its G}}."""
    layers = layer_weights(model)
    head = model.get_output_embeddings().weight
    out = {}
    for phase, w in work.items():
        backward = phase == "update"
        per_layer = 2 * w["M"] * s.layer_params * (3 if backward else 1)
        n = s.layers if w["M"] <= STREAMED else max(1, min(s.layers, int(BUDGET_FLOPS // per_layer)))
        rows = max(512, int(BUDGET_FLOPS // (2 * w["G"] * s.hidden * (3 if backward else 1))))
        lw = [x for ws in layers[:n] for x in ws]
        out[phase] = {
            "layers": matmul_rate(lw, w["M"], dtype, backward=backward, repeats=repeats),
            "head": matmul_rate([head[:rows]], w["G"], dtype, backward=backward, repeats=repeats),
        }
        if backward:  # the update's forward and backward apart (its breakdown's floors)
            for part in ("forward", "backward"):
                out[phase][f"layers_{part}"] = matmul_rate(lw, w["M"], dtype, backward=True,
                                                           repeats=repeats, products=part)
                out[phase][f"head_{part}"] = matmul_rate([head[:rows]], w["G"], dtype, backward=True,
                                                         repeats=repeats, products=part)
    return out


def floor_s(flops: dict[str, int], rate: dict[str, float], part: str = "") -> float:
    """The seconds of `flops` at `rate` (`part` "_forward" or "_backward": that part's rates)."""
    layers = (flops["layers"] + flops["attention"]) / (rate["layers" + part] * 1e9)
    return layers + flops["head"] / (rate["head" + part] * 1e9)


OPTIMIZER_BYTES = 28  # per parameter: AdamW reads p g m v and writes p m v (clip's two passes not counted)


def update_phases(m: dict, work: dict, rate: dict, params: int, gbs: float) -> list[dict]:
    """The update's phases (learn/phases.py: the step's time/update/* metrics) beside their floors:
    forward F and backward 2F over the update's tree (its F = the update's FLOPs / 3), the old and
    reference passes F each where they ran, the optimizer OPTIMIZER_BYTES per parameter at the
    copy bandwidth `gbs`; packing and the loss do no matmul; `other` is time/update_s less them
    (the update thread's hand-over, planning, the rows onto the device)."""
    f = {k: v // 3 for k, v in work["update"]["flops"].items()}
    fwd = floor_s(f, rate["update"], "_forward")
    bwd = floor_s({k: 2 * v for k, v in f.items()}, rate["update"], "_backward")
    floors = {"forward": fwd, "backward": bwd, "old": fwd, "reference": fwd,
              "optimizer": OPTIMIZER_BYTES * params / gbs / 1e9}
    rows = []
    for key in sorted(k for k in m if k.startswith("time/update/")):
        name = key.split("/")[-1][:-2]
        sec = m[key]
        if sec == 0.0 and name in ("old", "reference"):
            continue  # (not run: the engine's logprobs are the old ones; KL off)
        row = {"phase": name, "measured_s": sec}
        if name in floors:
            row["floor_s"] = floors[name]
            row["ratio"] = sec / floors[name]
        rows.append(row)
    other = m.get("time/update_s", 0.0) - sum(r["measured_s"] for r in rows)
    rows.append({"phase": "other", "measured_s": other})
    return rows


# ------------------------------------------------------------------ the step
def rss_gb() -> float:
    """The resident set now (VmRSS), GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def memory_per_phase() -> dict[str, float]:
    """{phase: the process's peak resident GB during it} of every update from now on (learn/
    update.py's Phases replaced by one that resets the peak as a phase starts and reads it as it
    ends); "before update": the peak from the step's start to its update (collect, rows),
    "update start": the resident set as the update starts."""
    import contextlib

    from tracetrain.learn import update
    from tracetrain.learn.phases import Phases
    from tracetrain.run.memory import peak_rss_gb, reset_peak

    peaks: dict[str, float] = {}

    class MemoryPhases(Phases):
        @contextlib.contextmanager
        def phase(self, name):
            if not peaks:
                peaks["before update"], peaks["update start"] = peak_rss_gb(), rss_gb()
            reset_peak()
            with super().phase(name):
                yield
            peaks[name] = max(peaks.get(name, 0.0), peak_rss_gb())

    update.Phases = MemoryPhases
    return peaks


async def real_step(args: argparse.Namespace, work: Path) -> dict:
    """One warm-up and one timed tracetrain step of bench_grpo_smollm2's shape: its metrics, the
    engine's and the store's seconds over the timed step, the requests it decoded."""
    import torch
    from bench_grpo_smollm2 import smollm2_trainer
    from bench_train_step import serving
    from transformers.utils import logging as hf_logging

    from tracetrain.run.memory import reset_peak

    hf_logging.disable_progress_bar()
    trainer = await smollm2_trainer(args, work)
    seen: list = []
    clocks = {"store_reads_s": 0.0, "store_commits_s": 0.0}
    peaks = memory_per_phase()

    def timed(fn, key):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clocks[key] += time.perf_counter() - t
        return run

    async with serving(trainer) as stepper:
        engine, store = stepper.engine, stepper.play.services.store
        inner = engine._run  # (serving's time_decoding: stats["decode_s"])

        def capture(reqs, *join):
            out = inner(reqs, *join)  # (the requests that joined are appended to reqs)
            seen.extend((list(r.prompt_ids), list(r.ids)) for r in reqs)
            return out

        engine._run = capture
        store.load_rollouts = timed(store.load_rollouts, "store_reads_s")
        store.turn_contexts = timed(store.turn_contexts, "store_reads_s")
        store._writer._commit = timed(store._writer._commit, "store_commits_s")
        for _ in range(1 + args.warmup):
            seen.clear()
            peaks.clear()
            reset_peak()
            clocks.update(dict.fromkeys(clocks, 0.0))
            before, load = dict(engine.stats), os.getloadavg()[0]
            t = time.perf_counter()
            m = await stepper.step()
            step_s = time.perf_counter() - t
        stats = {k: v - before.get(k, 0) for k, v in engine.stats.items() if k != "max_batch"}
    return {"metrics": m, "step_s": step_s, "engine": stats, "clocks": clocks, "requests": seen,
            "memory_gb": dict(peaks),
            "model": trainer.learner.model, "precision": trainer.cfg.trainer.precision,
            "engine_precision": engine.precision,
            "threads": torch.get_num_threads(), "load": [load, os.getloadavg()[0]]}


def breakdown(step: dict) -> dict[str, float]:
    m, e, c = step["metrics"], step["engine"], step["clocks"]
    parts = {"prefill": e["prefill_s"], "decode": e["decode_forward_s"], "sampling": e["sample_s"]}
    parts["engine other"] = e["decode_s"] - sum(parts.values())
    parts["gateway + agents"] = m["time/collect_s"] - e["decode_s"]
    parts["store reads"] = c["store_reads_s"]
    parts["rows"] = m["time/rows_s"] - c["store_reads_s"]
    parts["update"] = m.get("time/update_s", 0.0)
    parts["sync"] = m.get("time/sync_s", 0.0)
    parts["rest"] = step["step_s"] - m["time/collect_s"] - m["time/rows_s"] - parts["update"] - parts["sync"]
    return parts


def run(args: argparse.Namespace) -> dict:
    import torch

    from tracetrain.models.compute import on_compute

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
        step = asyncio.run(real_step(args, Path(tmp)))
    model = step.pop("model")
    s = Shapes.of(model.config)
    assert s.layers * s.layer_params == sum(w.numel() for ws in layer_weights(model) for w in ws), \
        "the config's shapes do not count the model's projections"
    want = args.prompts * 8 * args.new_tokens
    if sum(len(r) for _, r in step["requests"]) != want:
        raise SystemExit(f"the step did not decode exactly {want} tokens")
    work = step_work(s, step["requests"])
    units = bf16_units()
    bf16 = units or step["engine_precision"] == "bf16"  # (auto measured bf16 faster)
    dtypes = {"fp32": torch.float32} | ({"bf16": torch.bfloat16} if bf16 else {})
    rates = {name: on_compute(args.threads, phase_rates, model, s, work, dt, args.repeats)
             for name, dt in dtypes.items()}  # (where the model runs: models/compute.py)
    floors = {name: {p: floor_s(work[p]["flops"], r[p]) for p in work} for name, r in rates.items()}
    used = {"prefill": step["engine_precision"], "decode": step["engine_precision"],
            "update": "fp32" if step["precision"] == "fp32" else "bf16"}
    parts = breakdown(step)
    table = []
    for phase, sec in parts.items():
        row = {"phase": phase, "measured_s": sec}
        if phase in work:
            row["achieved_gflops"] = sum(work[phase]["flops"].values()) / 1e9 / sec
        if phase in work and used[phase] in floors:
            row["floor_s"] = floors[used[phase]][phase]
            row["ratio"] = sec / row["floor_s"]
        if phase in work and "bf16" in floors:
            row["floor_bf16_s"] = floors["bf16"][phase]
        table.append(row)
    gen_floor = sum(r.get("floor_s", 0.0) for r in table if r["phase"] in ("prefill", "decode"))
    m = step["metrics"]
    params = sum(p.numel() for p in model.parameters())
    gbs = on_compute(args.threads, bandwidth_gbs, args.repeats)
    update_rows = update_phases(m, work, rates[used["update"]], params, gbs)
    update_floor = sum(r.get("floor_s", 0.0) for r in update_rows)
    return {
        "cpu": cpu_name(), "bf16_units": units, "torch_threads": step["threads"],
        "precision": {"engine": step["engine_precision"], "update": step["precision"]},
        "shape": {"prompts": args.prompts, "rollouts": 8, "new_tokens": args.new_tokens},
        "model_shapes": s.__dict__, "load_average": step["load"],
        "work": {p: {"M": w["M"], "G": w["G"], "tokens": w["tokens"], "gflop": sum(w["flops"].values()) / 1e9,
                     "gflop_parts": {k: v / 1e9 for k, v in w["flops"].items()}} for p, w in work.items()},
        "engine_prefill_tokens": step["engine"]["prefill_tokens"],
        "engine_loops": step["engine"]["batches"], "engine_forward_calls": step["engine"]["forward_calls"],
        "update_tokens_computed": m.get("loss/tokens_computed"),
        "rates_gflops": rates, "table": table, "step_s": step["step_s"],
        "generation": {"measured_s": m["time/collect_s"], "floor_s": gen_floor,
                       "ratio": m["time/collect_s"] / gen_floor},
        "step_floor_s": sum(r.get("floor_s", 0.0) for r in table),
        "store_commits_s": step["clocks"]["store_commits_s"],
        "update": {"measured_s": m.get("time/update_s", 0.0), "floor_s": update_floor,
                   "ratio": m.get("time/update_s", 0.0) / update_floor, "phases": update_rows,
                   "bandwidth_gbs": gbs, "params": params},
        "memory_gb": {**step["memory_gb"], "step peak": max(step["memory_gb"].values(), default=0.0),
                      "weights fp32": params * 4 / 1e9, "grads fp32": params * 4 / 1e9,
                      "adamw states": params * 8 / 1e9,
                      "engine copy": params * 2 / 1e9 if step["engine_precision"] == "bf16" else 0.0},
    }


def report(r: dict) -> None:
    sh = r["shape"]
    print(f"CPU {r['cpu']}; bf16 units: {', '.join(r['bf16_units']) or 'none'}; torch threads "
          f"{r['torch_threads']}; precision: engine {r['precision']['engine']}, update "
          f"{r['precision']['update']}; load average {r['load_average'][0]:.1f} before the step, "
          f"{r['load_average'][1]:.1f} after")
    print(f"step: {sh['prompts']} questions x {sh['rollouts']} rollouts x {sh['new_tokens']} new tokens")
    print(f"\n{'phase':8s} {'M rows':>7s} {'tokens':>7s} {'GFLOP':>7s}  "
          + "  ".join(f"{d + ' layers':>11s} {d + ' head':>9s}" for d in r["rates_gflops"]) + "  (GFLOP/s)")
    for p, w in r["work"].items():
        rates = "  ".join(f"{x[p]['layers']:11.1f} {x[p]['head']:9.1f}" for x in r["rates_gflops"].values())
        print(f"{p:8s} {w['M']:7d} {w['tokens']:7d} {w['gflop']:7.1f}  {rates}")
    print(f"(the engine ran {r['engine_loops']} decode loop(s), {r['engine_forward_calls']} forward calls, "
          f"and forwarded {r['engine_prefill_tokens']} prompt tokens, the floor's tree has "
          f"{r['work']['prefill']['tokens']}; the update computed {r['update_tokens_computed']} "
          f"tokens, the floor's tree has {r['work']['update']['tokens']})")
    bf = "bf16" in r["rates_gflops"]
    print(f"\n{'phase':18s} {'measured s':>10s} {'floor s':>8s} {'measured/floor':>14s}"
          + (f" {'floor bf16 s':>12s}" if bf else "") + f" {'achieved GFLOP/s':>16s}")

    def line(name, sec, fl=None, ratio=None, fb=None, achieved=None):
        cells = [f"{name:18s} {sec:10.3f}", f"{fl:8.3f}" if fl is not None else f"{'-':>8s}",
                 f"{ratio:13.1f}x" if ratio is not None else f"{'-':>14s}"]
        if bf:
            cells.append(f"{fb:12.3f}" if fb is not None else f"{'-':>12s}")
        cells.append(f"{achieved:16.1f}" if achieved is not None else f"{'-':>16s}")
        print(" ".join(cells))

    for row in r["table"]:
        line(row["phase"], row["measured_s"], row.get("floor_s"), row.get("ratio"), row.get("floor_bf16_s"),
             row.get("achieved_gflops"))
    line("step", r["step_s"], r["step_floor_s"], r["step_s"] / r["step_floor_s"])
    g = r["generation"]
    line("generation", g["measured_s"], g["floor_s"], g["ratio"])
    print(f"(store group commits, in their thread during the collect: {r['store_commits_s']:.3f} s)")
    u = r["update"]
    print(f"\nthe update by phase (time/update/*; optimizer floor: {OPTIMIZER_BYTES} B x {u['params']:,} "
          f"parameters at {u['bandwidth_gbs']:.1f} GB/s), peak resident GB in each:")
    mem = r["memory_gb"]
    print(f"{'phase':18s} {'measured s':>10s} {'floor s':>8s} {'measured/floor':>14s} {'peak GB':>8s}")
    for row in [*u["phases"], {"phase": "update", **{k: u[k] for k in ("measured_s", "floor_s", "ratio")}}]:
        fl, ratio, gb = row.get("floor_s"), row.get("ratio"), mem.get(row["phase"])
        print(f"{row['phase']:18s} {row['measured_s']:10.3f} "
              + (f"{fl:8.3f} {ratio:13.1f}x" if fl is not None else f"{'-':>8s} {'-':>14s}")
              + (f" {gb:8.2f}" if gb is not None else f" {'-':>8s}"))
    print("memory, GB: " + ", ".join(f"{k} {v:.2f}" for k, v in mem.items() if k not in u["phases"]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the engine's, the update's)")
    ap.add_argument("--prompts", type=int, default=4, help="calculator questions per step")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per rollout")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=20, help="passes per matmul rate (the best)")
    ap.add_argument("--engine-precision", choices=["fp32", "bf16", "auto"], default="auto",
                    help="engine.precision (auto: bf16 where a decode step measures faster)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args(argv)
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        report(r)
    return r


if __name__ == "__main__":
    main()
