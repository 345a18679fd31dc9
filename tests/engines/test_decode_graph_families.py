"""The one-function decode step of the families past llama and qwen2 (engines/decode_llama.py:
qwen3, mistral, qwen2 with sliding layers; engines/decode_gemma3.py: gemma3_text): run eagerly it
gives the logits and the KV of transformers' forward over the same cache, bit for bit, in fp32 and
bf16, for any batch, padding, cache room and number of steps (hypothesis), with sliding-window
layers whose windows slide (a window of WINDOW tokens under up to 14); the engine's greedy and
seeded tokens and logprobs through it are those through transformers' forward, exactly, prefix
cache included; compiled (gemma3_text), its tokens are eager's and its logprobs agree to fp32
rounding; the families it does not run, and the configs of these it does not, are named and
decode through transformers' forward."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as tf
from decode_checks import compare
from families import FAMILIES, TOK, family_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_local import LOGPROB_ATOL

from tracetrain.engines import decode_gemma3, decode_graph, decode_llama
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.engines.precision import bf16_copy, shared_copy

WINDOW = 3
SLIDING, FULL = "sliding_attention", "full_attention"
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
GEMMA = dict(head_dim=16, sliding_window=WINDOW, layer_types=[SLIDING, FULL], query_pre_attn_scalar=12)
CONFIGS = {  # name: (config class, model class, fields beyond BASE)
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
    "qwen3_sliding": (tf.Qwen3Config, tf.Qwen3ForCausalLM,  # (layer 0 full, layer 1 sliding)
                      {"head_dim": 16, "use_sliding_window": True, "sliding_window": WINDOW,
                       "max_window_layers": 1, "attention_bias": True}),
    "qwen2_sliding": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                      {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
    "mistral_sliding": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": WINDOW}),
    "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, GEMMA),
    "gemma3_capped": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                      {**GEMMA, "final_logit_softcapping": 2.0, "attention_bias": True}),
}


@functools.cache
def _model(name: str) -> torch.nn.Module:
    """The tiny `name` model, random weights: matrices N(0, 0.1), vectors (norms, biases) their
    initial values plus N(0, 0.1) (Gemma's norms 1 + w: around 1, as Llama's)."""
    config_class, model_class, extra = CONFIGS[name]
    torch.manual_seed(3)
    model = model_class(config_class(**BASE, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    return model


@functools.cache
def _runner(name: str, precision: str) -> torch.nn.Module:
    """The engine's module for `name` in `precision` (engines/precision.py)."""
    return (shared_copy if precision == "fp32" else bf16_copy)(_model(name))


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["fp32", "bf16"]), st.lists(st.integers(1, 9), min_size=1, max_size=4),
       st.integers(1, 5), st.integers(0, 3), st.integers(0, 2**31))
def test_eager_step_gives_transformers_logits_and_kv(name, precision, lengths, steps, room, seed):
    runner = _runner(name, precision)
    graph = decode_graph.DecodeGraph(runner, compile=False)
    assert not graph.compiled and decode_graph.unsupported(runner) is None
    assert graph.step is (decode_gemma3 if name.startswith("gemma3") else decode_llama).decode_step
    assert graph.window == (None if name in ("qwen3", "mistral") else WINDOW)
    compare(graph, lengths, steps, room, seed)


@pytest.mark.parametrize("name", ["mistral_sliding", "gemma3_text", "qwen3_sliding"])
def test_the_windows_slide(name):
    """The steps of the test above see their windows: with the window wider than every prompt,
    the step's logits are no longer transformers'."""
    graph = decode_graph.DecodeGraph(_runner(name, "fp32"), compile=False)
    graph.window = 1000
    with pytest.raises(AssertionError):
        compare(graph, [9, 2], 2, 1, 0)


# --------------------------------------------------------------------------- the engine through it
SYSTEM = [{"role": "system", "content": "You are playing a game. Reply with the number only."}]
PROMPTS = [TOK.apply_chat_template(SYSTEM + [{"role": "user", "content": u}],
                                   add_generation_prompt=True)["input_ids"]
           for u in ("Guess.", "Guess a number between one and a hundred, please.", "Higher.")
           ] + [[5, 6, 7]]  # (39-50 tokens: past the families' 16-token windows; one short)


def _engines(kind: str, precision: str, **options) -> tuple[LocalEngine, LocalEngine]:
    """(an engine decoding through the one-function step, one through transformers' forward) of
    the tiny `kind` model of tests/support/families.py (hidden 64, windows of 16), its eos
    sampleable (no hook on its head) but no stop id: every row decodes its max_tokens."""
    model = family_model(kind, eos=True)
    fast, slow = (LocalEngine(model, TOK, precision=precision, seed=0, **options) for _ in "ab")
    slow._step = slow._forward
    for engine in (fast, slow):
        engine.stop_ids = frozenset()
    return fast, slow


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["qwen3", "mistral", "gemma3_text"])
def test_the_engine_decodes_transformers_tokens_and_logprobs_through_it(kind, precision):
    """Greedy, then seeded draws over later turns whose prefixes the prefix cache holds (rows with
    masked columns between their tokens): the same ids and logprobs, exactly."""
    fast, slow = _engines(kind, precision)
    assert fast.graph is not None and fast.graph_note == "one eager function (compile false)"
    steps = []
    fast.graph.fn = lambda *args, step=fast.graph.fn: steps.append(1) or step(*args)
    greedy, drawn = SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=8, seed=4)
    got, want = ([(g.response_ids, g.response_logprobs) for g in e.generate_batch(PROMPTS, greedy)]
                 for e in (fast, slow))
    assert got == want
    later = [p + ids + [7, 8] for p, (ids, _) in zip(PROMPTS, got, strict=True)]
    got, want = ([(g.response_ids, g.response_logprobs) for g in e.generate_batch(later, drawn)]
                 for e in (fast, slow))
    assert got == want
    assert fast.stats["prefix_cache_tokens"] > len(PROMPTS[0]) and len(steps) == 11 + 7


def test_compiled_gemma3_gives_eager_tokens_and_logprobs(monkeypatch, tmp_path):
    """Compiled and eager differ by the rounding of fused fp32 ops (LOGPROB_ATOL's budget:
    tests/engines/test_decode_graph.py); greedy rows give the same tokens unless two logits lie
    within that of each other. Inductor's kernels are built afresh here (an empty cache folder)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    eager, compiled = (LocalEngine(family_model("gemma3_text", eos=True), TOK, compile=c, seed=0)
                       for c in (False, True))
    assert compiled.graph_note == "one compiled graph"
    params = SamplingParams(max_tokens=24, temperature=0.0)
    for engine in (eager, compiled):
        engine.stop_ids = frozenset()
    want, got = (e.generate_batch(PROMPTS, params) for e in (eager, compiled))
    for a, b in zip(want, got, strict=True):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(b.response_logprobs),
                                   torch.tensor(a.response_logprobs), atol=LOGPROB_ATOL, rtol=0)


# --------------------------------------------------------------------------- what it does not run
def _gemma3(**fields) -> torch.nn.Module:
    return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**BASE, **GEMMA, **fields}))


@pytest.mark.parametrize("make,why", [
    (lambda: _gemma3(attn_logit_softcapping=50.0), "attention logit soft-capping (50.0)"),
    (lambda: _gemma3(use_bidirectional_attention=True), "bidirectional attention"),
    (lambda: _gemma3(hidden_activation="gelu"), "activation 'gelu'"),
    (lambda: _gemma3(rope_parameters={
        FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        SLIDING: {"rope_type": "default", "rope_theta": 1e4}}),
     "RoPE type 'linear' on full_attention layers"),
    (lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**BASE, hidden_act="gelu")), "activation 'gelu'"),
    (lambda: tf.MistralForCausalLM(tf.MistralConfig(**BASE, attention_dropout=0.1)),
     "attention dropout 0.1"),
])
def test_a_config_it_cannot_run_is_named(make, why):
    model = make()
    assert why in decode_graph.unsupported(model)
    graph, note = decode_graph.build(model, compile=True)
    assert graph is None and note.startswith("transformers' forward (") and why in note


@pytest.mark.parametrize("kind", [k for k in FAMILIES if k not in decode_graph.STEPS])
def test_the_other_families_decode_through_transformers(kind):
    graph, note = decode_graph.build(family_model(kind, eos=True), compile=False)
    assert graph is None
    assert note == (f"transformers' forward (model_type {kind!r} (llama, qwen2, qwen3, mistral, "
                    "gemma3_text are))")
