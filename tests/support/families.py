"""Tiny random models of the model families tracetrain serves and trains, built offline from their
transformers configs (hidden 64, 2-3 layers, random weights, eager attention) over the tiny
tokenizer's vocabulary (tracetrain/models/tiny.py), for tests/engines/test_families.py.

Sliding-window families get a window of WINDOW tokens, shorter than the tests' prompts, so that
their windows slide; lfm2 gets its real pattern of conv and attention layers. Each model's eos
can never be sampled (its logit lowered in the model itself, so that every reference sees it
too): a request decodes its whole max_tokens, and requests that join a batch find it running.
"""

from __future__ import annotations

import torch
import transformers as tf

from tracetrain.models.tiny import build_tokenizer

WINDOW = 16
MOE = {"num_experts_per_tok": 2}
FAMILIES = {  # model_type: (config class, model class, config fields beyond COMMON)
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  {"head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32, **MOE}),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": WINDOW}),
    "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                    {"head_dim": 16, "sliding_window": WINDOW,
                     "layer_types": ["sliding_attention", "full_attention"]}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": WINDOW}),
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM,
                {"head_dim": 16, "sliding_window": WINDOW, "num_local_experts": 4, **MOE,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {}),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, {}),
    "lfm2": (tf.Lfm2Config, tf.Lfm2ForCausalLM,
             {"num_hidden_layers": 3, "layer_types": ["conv", "conv", "full_attention"]}),
    "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM, {}),
}
TOK = build_tokenizer()
COMMON = dict(vocab_size=len(TOK), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id, bos_token_id=None,
              tie_word_embeddings=False, attn_implementation="eager")


def family_model(kind: str, seed: int = 0, eos: bool = False) -> torch.nn.Module:
    """The tiny random `kind` model in eval mode, fp32 (`eos`: its eos may be sampled)."""
    config_class, model_class, extra = FAMILIES[kind]
    config = config_class(**{**COMMON, **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).float().eval()
        for p in model.parameters():  # (some families initialize to tiny weights: flat logits)
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.1)
    model.generation_config.eos_token_id = TOK.eos_token_id
    model.generation_config.pad_token_id = TOK.pad_token_id
    if not eos:
        never = torch.zeros(len(TOK))
        never[TOK.eos_token_id] = -1e4
        model.get_output_embeddings().register_forward_hook(lambda m, i, out: out + never)
    return model
