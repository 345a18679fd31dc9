"""LocalEngine throughput on the tiny model: one batch vs concurrent requests vs one at a time,
and against transformers' own `generate` on the same batch (sampling, with logprobs).

    .venv/bin/python bench/bench_engine_local.py                  # 128 prompts x 8 tokens, 0.8M params
    .venv/bin/python bench/bench_engine_local.py --hidden 256 --layers 4 --max-tokens 64 --batch 8

The default case is the number-guessing demo's generation step: 128 agents' turns decoded at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch

from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.models.tiny import build_model, build_tokenizer


def game_prompts(tok, n: int) -> list[list[int]]:
    """Chat prompts like the demo's: a system line, the task, and 0-2 earlier guesses."""
    out = []
    for i in range(n):
        msgs = [
            {"role": "system", "content": "You are playing a game. Reply with the number only."},
            {"role": "user", "content": "I am thinking of a number between 1 and 8. Guess it."},
        ]
        for k in range(i % 3):
            msgs += [
                {"role": "assistant", "content": str(1 + (i + k) % 8)},
                {"role": "user", "content": "Higher."},
            ]
        out.append(tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])
    return out


def interleaved(modes: dict, repeats: int) -> dict[str, list[float]]:
    """Run every mode once per round, `repeats` rounds: other load on the machine hits all modes
    alike. Returns each mode's list of seconds."""
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(repeats):
        for name, fn in modes.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def hf_generate(model, tok, prompts, max_tokens):
    """transformers' generate on the same left-padded batch, sampling at T=1, with logprobs."""
    enc = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_new_tokens=max_tokens,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            min_new_tokens=max_tokens,  # no early eos: the same work as the engine's runs
            pad_token_id=tok.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        lp = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    return out.sequences[:, enc["input_ids"].shape[1] :], lp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sequential", type=int, default=32, help="prompts timed one at a time")
    args = ap.parse_args()

    tok = build_tokenizer()
    heads = max(2, args.hidden // 32)
    model = build_model(
        tok,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=heads,
        num_kv_heads=heads // 2,
    )
    n_params = sum(p.numel() for p in model.parameters())
    prompts = game_prompts(tok, args.batch)
    # no eos stop, so every configuration generates exactly batch x max_tokens tokens
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop_token_ids=())
    eng = LocalEngine(model, tok, max_batch_size=max(args.batch, 1))
    eng.stop_ids = frozenset()  # never stop early: every mode does batch x max_tokens of work
    lens = [len(p) for p in prompts]
    print(
        f"model {n_params / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers), "
        f"batch {args.batch}, prompt {min(lens)}-{max(lens)} tokens, {args.max_tokens} new tokens, "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    n_seq = min(args.sequential, args.batch)

    async def concurrent():
        return await asyncio.gather(*(eng.generate(p, params) for p in prompts))

    modes = {
        "LocalEngine.generate_batch (one batch)": lambda: eng.generate_batch(prompts, params),
        f"LocalEngine.generate x{args.batch} concurrent": lambda: asyncio.run(concurrent()),
        f"LocalEngine one prompt at a time (x{n_seq}, scaled)": lambda: [
            eng.generate_batch([p], params) for p in prompts[:n_seq]
        ],
        "transformers generate (same batch, sampling, scores)": lambda: hf_generate(
            model, tok, prompts, args.max_tokens
        ),
    }
    for fn in modes.values():  # warm up (first calls of a shape allocate)
        fn()
    before = dict(eng.stats)
    times = interleaved(modes, args.repeats)
    loops = (eng.stats["batches"] - before["batches"]) / args.repeats - n_seq - 1
    scale = {name: (args.batch / n_seq if "at a time" in name else 1.0) for name in modes}
    n_tok = args.batch * args.max_tokens
    print(f"{'mode':56s} {'min s':>8s} {'median s':>9s} {'tokens/s (min)':>15s}")
    best = {}
    for name, ts in times.items():
        lo, med = min(ts) * scale[name], statistics.median(ts) * scale[name]
        best[name] = lo
        print(f"{name:56s} {lo:8.3f} {med:9.3f} {n_tok / lo:15.0f}")
    b, c, one, hf = best.values()
    print(f"concurrent generate(): {loops:.1f} decode loops per {args.batch} requests")
    print(f"batched vs one at a time: {one / b:.1f}x faster")
    print(f"concurrent generate() vs generate_batch: {c / b:.2f}x the time")
    print(f"LocalEngine batch vs transformers generate: {hf / b:.2f}x faster")


if __name__ == "__main__":
    main()
