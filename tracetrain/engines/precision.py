"""The local engine's precision: the dtype its forward passes run in, and the module that holds it.

    fp32   the engine decodes with the weights of the module it is given (the trainer's: shared,
           no copy), through a copy of its modules that holds those same parameters and runs
           decode attention by grouped matmuls (engines/attention.py: no copies of the KV cache)
    bf16   with a bfloat16 copy of it: weights and KV cache in bf16 (half the bytes a decode
           step streams from memory), matmuls on the CPU's bf16 units (AVX-512 BF16, AMX), decode
           attention by grouped matmuls (engines/attention.py). The module stays what the trainer
           updates (in fp32); the copy takes its weights again whenever the engine is told they
           changed (LocalEngine.update_weights), so the engine serves the trainer's weights
           rounded to bf16 (relative error <= 2^-9 each).
    auto   bf16 where a decode step of the model runs at least `margin` faster in it, measured
           here (`faster_precision`: a batch of 32 rows, one token each over a 128-token cache
           of random KV); fp32 elsewhere (a CPU without bf16 units, e.g. Ice Lake, runs bf16
           slower)

In bf16 the engine's logprobs are the copy's, not the fp32 trainer's: their difference is what the
run reports as engine/logprob_gap_mean and _max (the same weights, before the step's update), and
what correction.old trainer with a correction.weight corrects for (objective/correction.py).
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import DynamicCache

from tracetrain.engines.attention import ATTENTION, MODEL_ATTENTION
from tracetrain.engines.layers import CONV, empty_cache, layer_kinds

ENGINE_PRECISIONS = ("fp32", "bf16", "auto")


def dense_input(module: torch.nn.Module, args: tuple) -> tuple:
    """args with args[0] dense in row-major order: contiguous, and strides that fold its leading
    dimensions into one (a [1, 1, h] slice of [1, S, h] is contiguous with batch stride S*h)."""
    x = args[0]
    if any(x.stride(i) != x.stride(i + 1) * x.size(i + 1) for i in range(x.dim() - 1)):
        x = x.clone(memory_format=torch.contiguous_format)
    return (x, *args[1:])


def _for_engine(runner: torch.nn.Module) -> torch.nn.Module:
    """`runner` with decode attention by grouped matmuls, and its lm head given a dense input
    (`dense_input`): a prefill's last positions, hidden[:, -1:] of [B, S, h], are a strided view,
    for which torch's matmul expands the [h, V] weight to [B, h, V] and copies it (its cost:
    docs/benchmarks.md, "Engine precision, requests that join a batch, the lm head's copy")."""
    inner = runner.get_base_model() if hasattr(runner, "get_base_model") else runner
    if inner.config._attn_implementation != ATTENTION:  # (what the model itself runs)
        setattr(inner.config, MODEL_ATTENTION, inner.config._attn_implementation)
    inner.set_attn_implementation(ATTENTION)
    inner.get_output_embeddings().register_forward_pre_hook(dense_input)
    return runner


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`model`'s modules copied around its own parameters and buffers (a weight the trainer
    changes is changed in both), decode attention by grouped matmuls; `model`'s attention, its
    active adapter and its train/eval mode are left as they are."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return _for_engine(copy.deepcopy(model, memo))


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A bfloat16 copy of `model` (a transformers model, or peft's around one) for inference:
    no gradients, eval mode, decode attention by grouped matmuls."""
    return _for_engine(copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False))


@torch.no_grad()
def refresh(runner: torch.nn.Module, model: torch.nn.Module) -> None:
    """`model`'s weights and buffers into `runner` (the same keys; cast to runner's dtype)."""
    source = model.state_dict()
    for name, t in runner.state_dict().items():
        t.copy_(source[name])


def pick(seconds: dict[str, float], margin: float) -> str:
    """"bf16" when its best time is at least `margin` below fp32's, else "fp32"."""
    return "bf16" if seconds["bf16"] <= (1 - margin) * seconds["fp32"] else "fp32"


def _random_cache(model: torch.nn.Module, batch: int, context: int, dtype: torch.dtype,
                  generator: torch.Generator) -> DynamicCache:
    """A KV cache of `batch` rows x `context` tokens of random keys and values, per attention layer
    [batch, kv heads, context, head dim] (a decode step's time does not depend on their values)."""
    c = model.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = (batch, kv_heads, context, head_dim)
    device = next(model.parameters()).device
    kinds = layer_kinds(model)
    cache = empty_cache(kinds)  # (a conv layer: no state yet, its step computes one)
    for layer, kind in zip(cache.layers, kinds, strict=True):
        if kind != CONV:
            layer.update(*(torch.randn(shape, generator=generator).to(device, dtype) for _ in "kv"))
    return cache


@torch.inference_mode()
def faster_precision(model: torch.nn.Module, runner: torch.nn.Module, *, batch: int = 32,
                     context: int = 128, repeats: int = 3, margin: float = 0.1
                     ) -> tuple[str, dict[str, float]]:
    """(pick(best seconds, margin), {"fp32": s, "bf16": s}): one decode step of `batch` rows over a
    `context`-token cache (random KV), with `model` (fp32: shared_copy) and `runner` (bf16_copy);
    a warm-up, then `repeats` timed steps each, alternating so that the machine's drift hits both."""
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (batch, 1), generator=g).to(device)
    position = torch.full((batch, 1), context, device=device)
    sides = (("fp32", model, torch.float32), ("bf16", runner, torch.bfloat16))
    best = {"fp32": float("inf"), "bf16": float("inf")}
    for k in range(1 + repeats):
        for p, m, dtype in sides[:: 1 if k % 2 == 0 else -1]:
            cache = _random_cache(m, batch, context, dtype, g)
            t = time.perf_counter()
            m(input_ids=ids, position_ids=position, past_key_values=cache, use_cache=True,
              logits_to_keep=1)
            if k:  # the first step of each builds kernels
                best[p] = min(best[p], time.perf_counter() - t)
    return pick(best, margin), best


def engine_precision(model: torch.nn.Module, precision: str
                     ) -> tuple[str, torch.nn.Module, dict[str, float] | None]:
    """(the precision chosen, the module the engine runs, auto's measured seconds or None)."""
    if precision not in ENGINE_PRECISIONS:
        raise ValueError(f"precision must be one of {ENGINE_PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return "fp32", shared_copy(model), None
    runner = bf16_copy(model)
    if precision == "bf16":
        return "bf16", runner, None
    shared = shared_copy(model)
    choice, seconds = faster_precision(shared, runner)
    return choice, runner if choice == "bf16" else shared, seconds
