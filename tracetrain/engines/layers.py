"""The kinds of a model's cache layers, as the local engine keeps them; checked when it starts.

transformers names each decoder layer's kind (`config.layer_types`; a config without it: every
layer sliding-window when `sliding_window` is set, full attention else). The local engine keeps:

    full_attention      keys and values [B, K, L, d] of every token (DynamicLayer; the decode's
                        reserved stores: engines/kv_cache.py)
    sliding_attention   the same, every token's keys and values (not transformers' last window
                        only): the attention mask keeps each query to the window of the positions
                        before it (engines/attention.py), so the prefix cache, joining and the
                        reserved stores treat the layer as full attention
    conv                a short convolution's state [B, C, k] (lfm2's ShortConv: the layer's last k
                        inputs, no keys): ConvLayer, one row per request, joined and dropped by
                        row. Its state at the end of a prefix is not a slice of the prefix's
                        tokens, so a model with conv layers prefills each prompt whole, without
                        the prefix cache (engines/prefill.py's `plain`)

Any other kind (chunked attention, a Mamba or linear-attention state, layers that share another
layer's KV) is refused when the engine is made: `layer_kinds` raises, naming the model_type; so is
a model whose forward pass does not run over that cache as its kinds say (`check_serves`: a
prefill of two tokens and one decode step, before any request).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

FULL, SLIDING, CONV = "full_attention", "sliding_attention", "conv"


class Unservable(ValueError):
    """The local engine cannot serve this model; the message names its model_type and why."""

KINDS = (FULL, SLIDING, CONV)


def layer_kinds(model: Any) -> list[str]:
    """Each decoder layer's kind (module docstring); Unservable naming the model_type for a kind
    the local engine does not serve."""
    config = model.config.get_text_config(decoder=True)
    kind = getattr(model.config, "model_type", None)
    if getattr(config, "num_kv_shared_layers", None):
        raise Unservable(f"the local engine cannot serve model_type {kind!r}: its layers share "
                         "another layer's keys and values (num_kv_shared_layers)")
    if getattr(config, "attention_chunk_size", None):
        raise Unservable(f"the local engine cannot serve model_type {kind!r}: chunked attention "
                         "(attention_chunk_size)")
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        kinds = [SLIDING if getattr(config, "sliding_window", None) is not None else FULL
                 ] * config.num_hidden_layers
    other = sorted({k for k in kinds if k not in KINDS})
    if other:
        raise Unservable(f"the local engine cannot serve model_type {kind!r}: layers of kind "
                         f"{', '.join(map(repr, other))} (it serves {', '.join(KINDS)})")
    return list(kinds)


def why_plain(model: Any, kinds: list[str]) -> str | None:
    """Why prompts are prefilled whole, without the prefix cache (None: through it)."""
    if CONV in kinds:
        return (f"model_type {model.config.model_type!r} has conv layers, whose state at the end "
                "of a prefix is not a slice of its tokens: prompts are prefilled whole, without "
                "the prefix cache")
    return None


class ConvLayer(LinearAttentionLayer):
    """A conv layer's state (transformers' LinearAttentionLayer) whose rows the decoder's batch
    selects and joins like the KV layers' (Cache.batch_select_indices, `joined`)."""

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_conv_states_initialized:
            self.conv_states = self.conv_states[indices]
        if self.is_recurrent_states_initialized:
            self.recurrent_states = self.recurrent_states[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_conv_states_initialized:
            self.conv_states = self.conv_states.repeat_interleave(repeats, dim=0)
        if self.is_recurrent_states_initialized:
            self.recurrent_states = self.recurrent_states.repeat_interleave(repeats, dim=0)

    @classmethod
    def joined(cls, a: LinearAttentionLayer, b: LinearAttentionLayer) -> ConvLayer:
        """A layer of `a`'s rows, then `b`'s (both prefilled: states initialized)."""
        out = cls()
        out.dtype, out.device = a.dtype, a.device
        out.has_previous_state = a.has_previous_state and b.has_previous_state
        if a.is_conv_states_initialized:
            out.conv_states = torch.cat([a.conv_states, b.conv_states])
            out.max_batch_size, out.conv_kernel_size = out.conv_states.shape[0], a.conv_kernel_size
            out.is_conv_states_initialized = True
        if a.is_recurrent_states_initialized:
            out.recurrent_states = torch.cat([a.recurrent_states, b.recurrent_states])
            out.is_recurrent_states_initialized = True
        return out


def empty_cache(kinds: list[str]) -> DynamicCache:
    """A cache for a prefill from no past: a DynamicLayer per attention layer (sliding ones
    included: every token kept), a ConvLayer per conv layer."""
    cache = DynamicCache()
    cache.layers = [ConvLayer() if k == CONV else DynamicLayer() for k in kinds]
    cache.layer_class_to_replicate = None
    return cache


def is_kv(layer: Any) -> bool:
    """Whether `layer` holds keys and values (an attention layer), not a conv state."""
    return isinstance(layer, DynamicLayer)


@torch.inference_mode()
def check_serves(runner: torch.nn.Module, kinds: list[str], device: torch.device) -> None:
    """A prefill of two tokens and a decode step of one over `empty_cache(kinds)`; Unservable
    naming the model_type where that fails or leaves the cache other than the kinds say (an
    attention layer without the three tokens' keys, a conv layer without a state)."""
    kind = getattr(runner.config, "model_type", None)
    cache = empty_cache(kinds)
    try:
        for ids, positions in (([[0, 0]], [[0, 1]]), ([[0]], [[2]])):
            out = runner(input_ids=torch.tensor(ids, device=device),
                         attention_mask=torch.ones((1, positions[0][-1] + 1), dtype=torch.long,
                                                   device=device),
                         position_ids=torch.tensor(positions, device=device),
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
    except Exception as e:
        raise Unservable(f"the local engine cannot serve model_type {kind!r}: a forward pass over "
                         f"its cache fails ({type(e).__name__}: {e})") from e
    if getattr(out, "past_key_values", None) is not cache or not all(
            layer.keys.shape[-2] == 3 if is_kv(layer) else layer.is_conv_states_initialized
            for layer in cache.layers):
        raise Unservable(f"the local engine cannot serve model_type {kind!r}: its forward pass "
                         "does not keep its state in the cache it is given as the layers' kinds "
                         f"({sorted(set(kinds))}) say")
