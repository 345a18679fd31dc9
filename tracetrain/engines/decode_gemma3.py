"""The one-function decode step of Gemma 3's text model (engines/decode_graph.py; model_type
gemma3_text, Gemma3ForCausalLM): Gemma's RMSNorm (N(x) = x / sqrt(mean(x^2) + eps) * (1 + w) in
float32, decode_ops.gemma_norm), four norms per layer, q/k norms, a gelu-tanh MLP, sliding-window
layers with their own RoPE base (rope_local_base_freq) and window. One decode step of B rows, one
token each, over the engine's KV stores (per layer keys and values [B, K, C, d], the step's token
written at column `col`):

    x = E[ids] * sqrt(h)                   (the scale cast to the model's dtype first)    [B, h]
    per layer:  a = N_in(x)
                q = N_q(a Wq + bq)  [B, H, d];   k = N_k(a Wk + bk),  v = a Wv + bv  [B, K, 1, d]
                x = x + N_post_attn(attend(q, k, v, the layer's mask, its RoPE) Wo + bo)
                a = N_pre_ff(x);  x = x + N_post_ff((gelu_tanh(a Wg) * (a Wu)) Wd)
    logits = N(x) W_head                                                             [B, V]
    logits = tanh(logits / cap) * cap      (final_logit_softcapping `cap`, where set)
    -> float32

attend's scaling query_pre_attn_scalar^-1/2; a sliding layer's mask the sliding one
(decode_ops.masks), its RoPE the sliding layers' inverse frequencies; a full layer's the full mask
and the full layers' frequencies.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tracetrain.engines.decode_ops import attend, gemma_norm, linear, rope_angles
from tracetrain.engines.layers import FULL, SLIDING, layer_kinds

MODEL_TYPES = ("gemma3_text",)


def unsupported(runner: torch.nn.Module) -> str | None:
    """Why `runner` (a Gemma3ForCausalLM) runs what `decode_step` does not (None: it does not)."""
    config = runner.config
    if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
        return f"activation {config.hidden_activation!r} (gelu_pytorch_tanh is)"
    rope = runner.model.rotary_emb
    for kind, rope_type in sorted(rope.rope_type.items()):
        if rope_type != "default" or getattr(rope, f"{kind}_attention_scaling") != 1.0:
            return f"RoPE type {rope_type!r} on {kind} layers (default is)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention)"
    if getattr(config, "attn_logit_softcapping", None) is not None:  # (transformers' forward decides)
        return f"attention logit soft-capping ({config.attn_logit_softcapping})"
    return None


def weights(runner: torch.nn.Module) -> dict[str, Any]:
    """`runner`'s tensors that `decode_step` reads (the module's own: an update in place shows);
    per layer (sliding?, the four norms, attention, MLP)."""
    m, rope = runner.model, runner.model.rotary_emb
    layers = []
    for layer, kind in zip(m.layers, layer_kinds(runner), strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        layers.append((kind == SLIDING,
                       (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        layer.pre_feedforward_layernorm.weight,
                        layer.post_feedforward_layernorm.weight),
                       (*linear(attn.q_proj), attn.q_norm.weight, *linear(attn.k_proj),
                        attn.k_norm.weight, *linear(attn.v_proj), *linear(attn.o_proj)),
                       (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)))
    first = m.layers[0].self_attn
    inv_freq = {kind: getattr(rope, f"{kind}_inv_freq", None) for kind in (FULL, SLIDING)}
    return {"embed": m.embed_tokens.weight, "embed_scale": m.embed_tokens.embed_scale,
            "norm": m.norm.weight, "head": linear(runner.lm_head), "inv_freq": inv_freq,
            "layers": layers, "eps": m.norm.eps, "heads": runner.config.num_attention_heads,
            "head_dim": first.head_dim, "scaling": first.scaling,
            "cap": runner.config.final_logit_softcapping}


def decode_step(w: dict[str, Any], keys: list[torch.Tensor], values: list[torch.Tensor],
                ids: torch.Tensor, positions: torch.Tensor, col: torch.Tensor,
                mask: torch.Tensor, window_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, V] float32 of the next token (module docstring): ids [B] and positions [B]
    int64, col [1] int64 (the column each row's k and v are written to, in place), mask and
    window_mask [B, C] additive in the model's dtype (decode_ops.masks; window_mask None without
    sliding layers), keys and values one [B, K, C, d] per layer."""
    B, H, d, eps = ids.shape[0], w["heads"], w["head_dim"], w["eps"]
    x = F.embedding(ids, w["embed"]) * w["embed_scale"].to(w["embed"].dtype)
    ropes = {kind: rope_angles(positions, f, x.dtype) for kind, f in w["inv_freq"].items()
             if f is not None}
    for (slide, (n_in, n_attn, n_pre, n_post), attn, (wg, wu, wd)), kc, vc in zip(
            w["layers"], keys, values, strict=True):
        wq, bq, qn, wk, bk, kn, wv, bv, wo, bo = attn
        a = gemma_norm(x, n_in, eps)
        K = kc.shape[1]
        q = gemma_norm(F.linear(a, wq, bq).view(B, H, d), qn, eps)
        k = gemma_norm(F.linear(a, wk, bk).view(B, K, 1, d), kn, eps)
        out = attend(q, k, F.linear(a, wv, bv).view(B, K, 1, d), kc, vc, col,
                     window_mask if slide else mask, w["scaling"], *ropes[SLIDING if slide else FULL])
        x = x + gemma_norm(F.linear(out, wo, bo), n_attn, eps)
        a = gemma_norm(x, n_pre, eps)
        mlp = F.linear(F.gelu(F.linear(a, wg), approximate="tanh") * F.linear(a, wu), wd)
        x = x + gemma_norm(mlp, n_post, eps)
    logits = F.linear(gemma_norm(x, w["norm"], eps), *w["head"])
    if w["cap"] is not None:
        logits = torch.tanh(logits / w["cap"]) * w["cap"]
    return logits.float()
