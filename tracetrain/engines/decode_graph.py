"""A decode step as one function of tensors, compiled into one graph where torch can compile here.

For a Llama-family model (transformers' llama and qwen2: RMSNorm, default RoPE, grouped-query
attention, SwiGLU; biases where the model has them), one decode step of B rows, one token each,
over the engine's reserved KV stores (engines/kv_cache.py: per layer keys and values [B, K, C, d],
C columns, the step's token written at column `col`):

    x = E[ids]                                                         [B, h]
    per layer:  a = RMSNorm(x);  q = rope(a Wq + bq);  k = rope(a Wk + bk);  v = a Wv + bv
                keys[:, :, col] = k;  values[:, :, col] = v
                x = x + attend(q, keys, values, mask) Wo + bo          (engines/attention.py)
                a = RMSNorm(x);  x = x + (silu(a Wg + bg) * (a Wu + bu)) Wd + bd
    logits = RMSNorm(x) W_head + b_head                                [B, V] float32

in the order and dtypes of transformers' modules, so that run eagerly it gives their logits (the
same kernels on the same shapes). `mask` [B, C] is additive: 0 on the columns a row attends to,
the dtype's lowest value elsewhere (padding, and the columns past the step's token), as
transformers' eager masks. Compiled (torch.compile, inductor's CPU backend: C++ that gcc builds
here), one graph runs the step: no Python between ops, the elementwise ops between the matmuls
fused; it rounds differently (inductor keeps float32 between fused bf16 ops), so compiled and
eager agree to the dtype's rounding, not bit for bit. Where inductor cannot build (no C++
compiler), the step runs eagerly. Other models (another architecture, LoRA adapters, a sliding
window, scaled RoPE, attention dropout, a forward hook: what transformers would run and this
function would not) decode through transformers' forward: `unsupported` says why.

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
import torch.nn.functional as F

from tracetrain.engines.precision import dense_input

log = logging.getLogger("tracetrain.engine")

BACKEND = "inductor"  # torch.compile's backend for the step (a test may choose a cheaper one)
_LIMIT_HIT = "Dynamo recompile limit exceeded"  # (the start of dynamo's message when it falls back)
_ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def unsupported(runner: torch.nn.Module) -> str | None:
    """Why `runner`'s decode step cannot be `decode_step` (None: it can)."""
    if hasattr(runner, "get_base_model"):
        return "LoRA adapters (peft)"
    kind = getattr(runner.config, "model_type", None)
    if kind not in ("llama", "qwen2"):
        return f"model_type {kind!r} (llama and qwen2 are)"
    if getattr(runner.config, "hidden_act", None) != "silu":
        return f"activation {runner.config.hidden_act!r} (silu is)"
    rope = runner.model.rotary_emb
    if rope.rope_type != "default" or rope.attention_scaling != 1.0:
        return f"RoPE type {rope.rope_type!r} (default is)"
    if getattr(runner.config, "attention_dropout", 0.0):
        return f"attention dropout {runner.config.attention_dropout}"
    for layer in runner.model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            return "a sliding-window layer"
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "a global forward hook"
    for name, module in runner.named_modules():  # (a hook changes what transformers computes)
        pre = [h for h in module._forward_pre_hooks.values() if h is not dense_input]
        if pre or module._forward_hooks:
            return f"a forward hook on {name or 'the model'}"
    return None


def _linear(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight, module.bias


def weights(runner: torch.nn.Module) -> dict[str, Any]:
    """`runner`'s tensors that `decode_step` reads (the module's own: an update in place shows)."""
    m = runner.model
    layers = []
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append((layer.input_layernorm.weight, *_linear(attn.q_proj), *_linear(attn.k_proj),
                       *_linear(attn.v_proj), *_linear(attn.o_proj),
                       layer.post_attention_layernorm.weight, *_linear(mlp.gate_proj),
                       *_linear(mlp.up_proj), *_linear(mlp.down_proj)))
    first = m.layers[0].self_attn
    return {"embed": m.embed_tokens.weight, "norm": m.norm.weight, "head": _linear(runner.lm_head),
            "inv_freq": m.rotary_emb.inv_freq, "layers": layers, "eps": m.norm.variance_epsilon,
            "heads": runner.config.num_attention_heads, "head_dim": first.head_dim,
            "scaling": first.scaling}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), the mean in float32 (transformers' LlamaRMSNorm)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin, rotate_half(x) = (-x[d/2:], x[:d/2]); x [B, heads, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def decode_step(w: dict[str, Any], keys: list[torch.Tensor], values: list[torch.Tensor],
                ids: torch.Tensor, positions: torch.Tensor, col: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] float32 of the next token (module docstring): ids [B] and positions [B]
    int64, col [1] int64 (the column each row's k and v are written to, in place), mask [B, C]
    additive in the model's dtype, keys and values one [B, K, C, d] per layer."""
    B, H, d, eps = ids.shape[0], w["heads"], w["head_dim"], w["eps"]
    x = F.embedding(ids, w["embed"])
    freqs = positions[:, None].float() * w["inv_freq"][None, :].float()
    angles = torch.cat((freqs, freqs), -1)
    cos, sin = angles.cos().to(x.dtype)[:, None, :], angles.sin().to(x.dtype)[:, None, :]
    for (n1, wq, bq, wk, bk, wv, bv, wo, bo, n2, wg, bg, wu, bu, wd, bd), kc, vc in zip(
            w["layers"], keys, values, strict=True):
        a = _rms_norm(x, n1, eps)
        q = _rope(F.linear(a, wq, bq).view(B, H, d), cos, sin)
        K = kc.shape[1]
        kc.index_copy_(2, col, _rope(F.linear(a, wk, bk).view(B, K, 1, d), cos[:, None], sin[:, None]))
        vc.index_copy_(2, col, F.linear(a, wv, bv).view(B, K, 1, d))
        scores = torch.matmul(q.view(B, K, H // K, d), kc.transpose(2, 3)) * w["scaling"]
        scores = scores + mask[:, None, None, :]
        attn = torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(x.dtype), vc)
        x = x + F.linear(attn.reshape(B, H * d), wo, bo)
        a = _rms_norm(x, n2, eps)
        x = x + F.linear(F.silu(F.linear(a, wg, bg)) * F.linear(a, wu, bu), wd, bd)
    return F.linear(_rms_norm(x, w["norm"], eps), *w["head"]).float()


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
    """The decode step of a supported runner (`unsupported` is None) over a cache of
    kv_cache.ReservedLayer layers, called as the decoder's _forward is for a decode step; compiled
    when `compile` and inductor builds here (`compiled`), else eager (`reason` says why).
    Compiled, its graphs are its own (module docstring); `fallback` is None until dynamo runs a
    step of it eagerly at a recompile limit, then says so (and the log has said it once)."""

    def __init__(self, runner: torch.nn.Module, compile: bool,
                 stats: MutableMapping[str, Any] | None = None):
        self.runner, self.stats = runner, stats
        self.dtype = runner.model.embed_tokens.weight.dtype
        self.reason = inductor_builds() if compile else "compile false"
        self.compiled = self.reason is None
        self.fallback: str | None = None
        own = {"isolate_recompiles": True} if _ISOLATES else {}  # (torch 2.13 has it)
        self.fn = (torch.compile(decode_step, dynamic=True, backend=BACKEND, **own)
                   if self.compiled else decode_step)

    def _full(self) -> str | None:
        """Which of dynamo's limits this step's region of its cache has reached (None: neither)."""
        from torch._dynamo import config, eval_frame

        if hasattr(eval_frame, "_get_cache_entries_for_region"):
            graphs = len(eval_frame._get_cache_entries_for_region(decode_step,
                                                                   self.fn._isolate_recompiles_id))
            total = eval_frame._get_total_cache_entry_count(decode_step)
        else:  # a torch without isolate_recompiles: one region, every engine's
            graphs = total = len(
                torch._C._dynamo.eval_frame._debug_get_cache_entry_list(decode_step.__code__))
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
        mask = torch.full((ids.shape[0], C), torch.finfo(self.dtype).min, dtype=self.dtype,
                          device=ids.device)
        mask[:, : L + 1].masked_fill_(attention_mask.bool(), 0.0)
        col = torch.tensor([L], device=ids.device)
        logits = self._step(weights(self.runner), list(keys), list(values), ids,
                            position_ids[:, 0], col, mask)
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
