"""The one-function decode step of the Llama family (engines/decode_graph.py): llama, qwen2, qwen3
and mistral (RMSNorm, default RoPE, grouped-query attention, SwiGLU; biases where the model has
them; qwen3's q_norm and k_norm; sliding-window layers where the config makes them: mistral with
`sliding_window` set, qwen2/qwen3 with use_sliding_window). One decode step of B rows, one token
each, over the engine's KV stores (per layer keys and values [B, K, C, d], the step's token
written at column `col`):

    x = E[ids]                                                          [B, h]
    per layer:  a = RMSNorm(x)
                q = a Wq + bq  [B, H, d];   k = a Wk + bk,  v = a Wv + bv  [B, K, 1, d]
                q, k = RMSNorm(q, q_norm), RMSNorm(k, k_norm)   (qwen3: per head, over d)
                x = x + attend(q, k, v, the layer's mask) Wo + bo      (decode_ops.attend)
                a = RMSNorm(x);  x = x + (silu(a Wg + bg) * (a Wu + bu)) Wd + bd
    logits = RMSNorm(x) W_head + b_head                                 [B, V] float32

the layer's mask the sliding one for a sliding layer (decode_ops.masks), the full one else.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tracetrain.engines.decode_ops import attend, linear, rms_norm, rope_angles, swiglu
from tracetrain.engines.layers import SLIDING, layer_kinds

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def unsupported(runner: torch.nn.Module) -> str | None:
    """Why `runner` (one of MODEL_TYPES) runs what `decode_step` does not (None: it does not)."""
    if getattr(runner.config, "hidden_act", None) != "silu":
        return f"activation {runner.config.hidden_act!r} (silu is)"
    rope = runner.model.rotary_emb
    if rope.rope_type != "default" or rope.attention_scaling != 1.0:
        return f"RoPE type {rope.rope_type!r} (default is)"
    return None


def weights(runner: torch.nn.Module) -> dict[str, Any]:
    """`runner`'s tensors that `decode_step` reads (the module's own: an update in place shows);
    per layer (sliding?, input norm, attention, post-attention norm, MLP)."""
    m = runner.model
    layers = []
    for layer, kind in zip(m.layers, layer_kinds(runner), strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        qn, kn = (getattr(getattr(attn, n, None), "weight", None) for n in ("q_norm", "k_norm"))
        layers.append((kind == SLIDING, layer.input_layernorm.weight,
                       (*linear(attn.q_proj), qn, *linear(attn.k_proj), kn, *linear(attn.v_proj),
                        *linear(attn.o_proj)),
                       layer.post_attention_layernorm.weight,
                       (*linear(mlp.gate_proj), *linear(mlp.up_proj), *linear(mlp.down_proj))))
    first = m.layers[0].self_attn
    return {"embed": m.embed_tokens.weight, "norm": m.norm.weight, "head": linear(runner.lm_head),
            "inv_freq": m.rotary_emb.inv_freq, "layers": layers, "eps": m.norm.variance_epsilon,
            "heads": runner.config.num_attention_heads, "head_dim": first.head_dim,
            "scaling": first.scaling}


def decode_step(w: dict[str, Any], keys: list[torch.Tensor], values: list[torch.Tensor],
                ids: torch.Tensor, positions: torch.Tensor, col: torch.Tensor,
                mask: torch.Tensor, window_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, V] float32 of the next token (module docstring): ids [B] and positions [B]
    int64, col [1] int64 (the column each row's k and v are written to, in place), mask and
    window_mask [B, C] additive in the model's dtype (decode_ops.masks; window_mask None without
    sliding layers), keys and values one [B, K, C, d] per layer."""
    B, H, d, eps = ids.shape[0], w["heads"], w["head_dim"], w["eps"]
    x = F.embedding(ids, w["embed"])
    cos, sin = rope_angles(positions, w["inv_freq"], x.dtype)
    for (slide, n1, (wq, bq, qn, wk, bk, kn, wv, bv, wo, bo), n2, mlp), kc, vc in zip(
            w["layers"], keys, values, strict=True):
        a = rms_norm(x, n1, eps)
        K = kc.shape[1]
        q, k = F.linear(a, wq, bq).view(B, H, d), F.linear(a, wk, bk).view(B, K, 1, d)
        if qn is not None:  # (qwen3)
            q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
        out = attend(q, k, F.linear(a, wv, bv).view(B, K, 1, d), kc, vc, col,
                     window_mask if slide else mask, w["scaling"], cos, sin)
        x = x + F.linear(out, wo, bo)
        x = x + swiglu(rms_norm(x, n2, eps), *mlp)
    return F.linear(rms_norm(x, w["norm"], eps), *w["head"]).float()
