"""A decode step as one function of tensors, compiled into one graph where torch can compile here.

One decode step of B rows, one token each, over the engine's reserved KV stores
(engines/kv_cache.py: per layer keys and values [B, K, C, d], C columns, the step's token written
at column `col`), as one function of tensors per family:

    llama, qwen2, qwen3, mistral    engines/decode_llama.py (RMSNorm, RoPE, grouped-query
                                    attention, SwiGLU; qwen3's q/k norms)
    gemma3_text                     engines/decode_gemma3.py (Gemma's norms, four a layer, q/k
                                    norms, gelu-tanh MLP, a RoPE base per layer kind, soft-capped
                                    logits)

    step(weights, keys, values, ids [B], positions [B], col [1], mask [B, C], window_mask [B, C])
        -> logits [B, V] float32;  keys[l][:, :, col], values[l][:, :, col] written in place

in the order and dtypes of transformers' modules, so that run eagerly it gives their logits (the
same kernels on the same shapes). The masks are additive (engines/decode_ops.py masks): 0 on the
columns a row attends to, the dtype's lowest value elsewhere (padding, the columns past the step's
token, and for a sliding-window layer, window_mask, the tokens `sliding_window` positions or more
before the step's), as the engine's eager masks (engines/attention.py). Compiled (torch.compile,
inductor's CPU backend: C++ that gcc builds here), one graph runs the step: no Python between ops,
the elementwise ops between the matmuls fused; it rounds differently (inductor keeps float32
between fused bf16 ops), so compiled and eager agree to the dtype's rounding, not bit for bit.
Where inductor cannot build (no C++ compiler), the step runs eagerly. Other models (another
architecture, LoRA adapters, scaled RoPE, another activation, attention dropout, gemma3's
attention soft-capping or bidirectional attention, a forward hook: what transformers would run and
these functions would not) decode through transformers' forward: `unsupported` says why.

dynamo keeps its compiled graphs on the function's code object, and after
torch._dynamo.config.recompile_limit graphs (8 by default) a new shape or model runs eagerly. Each
DecodeGraph compiles its own region of that cache (torch.compile's isolate_recompiles; a torch
without it has one region for all), so every engine in a process has the whole limit to itself:
other engines' models, batch sizes and numbers of layers take none of it. Where an engine's step
does fall back (its own limit, or config.accumulated_recompile_limit, the cap over all regions of
the code object), it logs a warning once, on the logger "tracetrain.engine".
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import MutableMapping
from typing import Any

import torch

from tracetrain.engines import decode_gemma3, decode_llama
from tracetrain.engines.decode_ops import masks
from tracetrain.engines.layers import SLIDING, layer_kinds
from tracetrain.engines.precision import dense_input

log = logging.getLogger("tracetrain.engine")

BACKEND = "inductor"  # torch.compile's backend for the step (a test may choose a cheaper one)
_LIMIT_HIT = "Dynamo recompile limit exceeded"  # (the start of dynamo's message when it falls back)
_ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters
# model_type -> the module of its family's step (unsupported, weights, decode_step)
STEPS = {kind: family for family in (decode_llama, decode_gemma3) for kind in family.MODEL_TYPES}


def unsupported(runner: torch.nn.Module) -> str | None:
    """Why `runner`'s decode step cannot be its family's one function (None: it can)."""
    if hasattr(runner, "get_base_model"):
        return "LoRA adapters (peft)"
    kind = getattr(runner.config, "model_type", None)
    if kind not in STEPS:
        return f"model_type {kind!r} ({', '.join(STEPS)} are)"
    why = STEPS[kind].unsupported(runner)
    if why is not None:
        return why
    if getattr(runner.config, "attention_dropout", 0.0):
        return f"attention dropout {runner.config.attention_dropout}"
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "a global forward hook"
    for name, module in runner.named_modules():  # (a hook changes what transformers computes)
        pre = [h for h in module._forward_pre_hooks.values() if h is not dense_input]
        if pre or module._forward_hooks:
            return f"a forward hook on {name or 'the model'}"
    return None


@functools.cache
def inductor_builds() -> str | None:
    """None where torch.compile's CPU backend builds and runs a kernel here, else why not."""
    _cache_per_capability()
    try:
        x = torch.arange(4.0)
        got = torch.compile(lambda t: t * 2 + 1, dynamic=False)(x)
        if not torch.equal(got, x * 2 + 1):
            return "torch.compile gave a wrong result"
    except Exception as e:  # no C++ compiler, a broken toolchain: the step runs eagerly
        return f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}"
    return None


def _cache_per_capability() -> None:
    """Inductor's on-disk cache in a folder of this ATEN_CPU_CAPABILITY's own, where one is set
    and the cache's folder is torch's default: torch 2.13 reuses a kernel built under another
    capability (measured: wrong ids decoded, or a C++ compile error)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability, default = os.environ.get("ATEN_CPU_CAPABILITY"), default_cache_dir()
    if capability and os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{capability}"


def _limit_hits() -> int:
    """How many times dynamo has fallen back to eager at a recompile limit in this process."""
    from torch._dynamo.utils import counters

    return sum(n for msg, n in counters["unimplemented"].items() if msg.startswith(_LIMIT_HIT))


class DecodeGraph:
    """The decode step of a supported runner (`unsupported` is None: its family's `step`, given
    the full mask and, with sliding layers, the window mask) over a cache of
    kv_cache.ReservedLayer layers, called as the decoder's _forward is for a decode step; compiled
    when `compile` and inductor builds here (`compiled`), else eager (`reason` says why).
    Compiled, its graphs are its own (module docstring); `fallback` is None until dynamo runs a
    step of it eagerly at a recompile limit, then says so (and the log has said it once)."""

    def __init__(self, runner: torch.nn.Module, compile: bool,
                 stats: MutableMapping[str, Any] | None = None):
        self.runner, self.stats = runner, stats
        self.dtype = runner.model.embed_tokens.weight.dtype
        self.family = STEPS[runner.config.model_type]
        self.step = self.family.decode_step  # (each family's its own code object: its own graphs)
        # the sliding layers' window (None: no sliding layer, no window mask)
        self.window = runner.config.sliding_window if SLIDING in layer_kinds(runner) else None
        self.reason = inductor_builds() if compile else "compile false"
        self.compiled = self.reason is None
        self.fallback: str | None = None
        own = {"isolate_recompiles": True} if _ISOLATES else {}  # (torch 2.13 has it)
        self.fn = (torch.compile(self.step, dynamic=True, backend=BACKEND, **own)
                   if self.compiled else self.step)

    def _full(self) -> str | None:
        """Which of dynamo's limits this step's region of its cache has reached (None: neither)."""
        from torch._dynamo import config, eval_frame

        if hasattr(eval_frame, "_get_cache_entries_for_region"):
            graphs = len(eval_frame._get_cache_entries_for_region(self.step,
                                                                   self.fn._isolate_recompiles_id))
            total = eval_frame._get_total_cache_entry_count(self.step)
        else:  # a torch without isolate_recompiles: one region, every engine's
            graphs = total = len(
                torch._C._dynamo.eval_frame._debug_get_cache_entry_list(self.step.__code__))
        limit = getattr(config, "recompile_limit", None) or config.cache_size_limit
        if graphs >= limit:
            return f"torch._dynamo.config.recompile_limit ({limit} graphs, its own)"
        if total >= config.accumulated_recompile_limit:
            return (f"torch._dynamo.config.accumulated_recompile_limit "
                    f"({config.accumulated_recompile_limit} graphs, over all engines in the process)")
        return None

    def _step(self, *args: Any) -> torch.Tensor:
        """self.fn(*args), noting (once) a fall back to eager at a recompile limit: dynamo counts
        one when it gives up compiling a frame; it was this step's where its region is full."""
        if not self.compiled or self.fallback is not None:
            return self.fn(*args)
        hits = _limit_hits()
        out = self.fn(*args)
        if _limit_hits() > hits and (full := self._full()) is not None:
            self.fallback = (f"the compiled decode step reached {full}: a step its graphs do "
                             "not cover runs eagerly (correct, slower)")
            log.warning("engine: %s", self.fallback)
        return out

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, cache: Any, adapters: None = None
                 ) -> tuple[torch.Tensor, Any]:
        """(logits [B, V] float32, cache) for input_ids [B, 1] at position_ids [B, 1];
        attention_mask [B, L + 1] of 0/1 (the cache's L tokens and this one); the cache's layers
        take the step's keys and values."""
        if self.stats is not None:
            self.stats["forward_calls"] += 1
        ids, layers = input_ids[:, 0], cache.layers
        for layer in layers:
            layer.make_room(1)
        keys, values = zip(*(layer.stores for layer in layers), strict=True)
        L, C = layers[0].length, keys[0].shape[-2]
        mask, window_mask = masks(attention_mask, C, self.dtype, self.window)
        col = torch.tensor([L], device=ids.device)
        logits = self._step(self.family.weights(self.runner), list(keys), list(values), ids,
                            position_ids[:, 0], col, mask, window_mask)
        for layer in layers:
            layer.advance(1)
        return logits, cache


def build(runner: torch.nn.Module, compile: bool, stats: MutableMapping[str, Any] | None = None
          ) -> tuple[DecodeGraph | None, str]:
    """(the engine's decode step: a DecodeGraph, or None for transformers' forward; what was
    chosen, and why) for `runner` and the engine's `compile`."""
    why = unsupported(runner)
    if why is not None:
        return None, f"transformers' forward ({why})"
    graph = DecodeGraph(runner, compile, stats)
    return graph, "one compiled graph" if graph.compiled else f"one eager function ({graph.reason})"
