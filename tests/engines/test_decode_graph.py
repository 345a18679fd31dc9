"""The decode step as one function (engines/decode_graph.py): run eagerly it gives the logits and
the KV of transformers' forward over the same cache, bit for bit, for Llama and Qwen2 (q/k/v
biases), any batch, padding, cache room and number of steps (hypothesis); compiled, the engine's
seeded tokens are eager's and its logprobs agree to fp32 rounding; each engine's compiled step
has dynamo's recompile limit to itself, and says once when it falls back to eager at it; a model
it cannot run is named and decodes through transformers' forward; where torch.compile fails, the
step runs eagerly."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from decode_checks import compare, prefill
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_local import LOGPROB_ATOL
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tracetrain.engines import decode_graph, decode_llama
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.kv_cache import reserve
from tracetrain.engines.local import LocalEngine
from tracetrain.engines.precision import shared_copy
from tracetrain.models.tiny import build_model, build_tokenizer

TOK = build_tokenizer()
LLAMA = build_model(TOK, seed=1)


def _qwen2() -> Qwen2ForCausalLM:
    """A tiny Qwen2 (its q/k/v projections have biases), random weights."""
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(2)
    return Qwen2ForCausalLM(config).eval()


QWEN2 = _qwen2()


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["llama", "qwen2"]), st.lists(st.integers(1, 9), min_size=1, max_size=4),
       st.integers(1, 5), st.integers(0, 3), st.integers(0, 2**31))
@torch.inference_mode()
def test_eager_step_gives_transformers_logits_and_kv(kind, lengths, steps, room, seed):
    model = LLAMA if kind == "llama" else QWEN2
    runner = shared_copy(model)  # (the engine's fp32 runner: grouped decode attention)
    graph = decode_graph.DecodeGraph(runner, compile=False)
    assert not graph.compiled
    compare(graph, lengths, steps, room, seed)


def _prompts():
    texts = ["Guess a number between 1 and 8.", "Higher.", "What is 12 + 30? Think step by step."]
    return [TOK.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)[
        "input_ids"] for t in texts] + [[5]]


def test_compiled_step_gives_eager_tokens_and_logprobs(monkeypatch, tmp_path):
    """A batch whose rows end apart (the batch shrinks) and decode past their stores' room (the
    stores grow): the graph is built for dynamic shapes. Compiled and eager differ only by the
    rounding of fused fp32 ops (a few u per op on |logit| < ~2: LOGPROB_ATOL's budget), and
    seeded draws give the same tokens unless a draw falls within that of a boundary.
    Inductor's kernels are built afresh here (an empty cache folder)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    decode_graph.inductor_builds.cache_clear()
    assert decode_graph.inductor_builds() is None  # gcc is on these machines: it must compile
    eager, compiled = (LocalEngine(LLAMA, TOK, compile=c, seed=0) for c in (False, True))
    assert compiled.graph.compiled and not eager.graph.compiled
    assert compiled.graph_note == "one compiled graph"
    params = [SamplingParams(max_tokens=n, seed=k, temperature=1.0)
              for k, n in enumerate([3, 90, 20, 70])]
    for engine in (eager, compiled):
        engine.stop_ids = frozenset()  # every row to its max_tokens
    want, got = (e.generate_batch(_prompts(), params) for e in (eager, compiled))
    for a, b in zip(want, got, strict=True):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(b.response_logprobs),
                                   torch.tensor(a.response_logprobs), atol=LOGPROB_ATOL, rtol=0)
    assert [len(g.response_ids) for g in got] == [3, 90, 20, 70]


def _step(graph, batch: int) -> torch.Tensor:
    """The logits of one decode step of `graph` over a prefill of `batch` rows of 3 tokens."""
    vocab = graph.runner.config.vocab_size
    ids = torch.arange(3 * batch).view(batch, 3) % (vocab - 1) + 1
    mask = torch.ones(batch, 3, dtype=torch.int64)
    cache, pos = prefill(graph.runner, ids, mask)
    y, mask = ids[:, :1], torch.cat([mask, mask.new_ones(batch, 1)], -1)
    return graph(y, mask, (pos + 1)[:, None], reserve(cache, 2))[0]


@torch.inference_mode()
def test_each_engine_has_its_own_recompile_limit(monkeypatch, caplog, request):
    """dynamo keeps compiled graphs per code object, and past torch._dynamo.config.recompile_limit
    a new guard runs eagerly: engines of three models (another number of layers: another graph)
    each compile their own step although the limit is 1; one engine past its own limit (batch 1
    after batch 2: a recompile) logs once that it falls back, runs that step eagerly, and its
    graph and the others' still run. The backend runs dynamo's graph as captured (not inductor's
    build: which graphs dynamo keeps, and where, is the same), counting its compiles and runs."""
    compiled, runs = [], []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return lambda *args: runs.append(gm) or gm.forward(*args)

    monkeypatch.setattr(decode_graph, "inductor_builds", lambda: None)
    monkeypatch.setattr(decode_graph, "BACKEND", backend)
    # (torch's own patch: monkeypatch's undo leaves a torch config key deleted, and later compiles fail)
    limit = torch._dynamo.config.patch(recompile_limit=1)
    limit.__enter__()
    request.addfinalizer(lambda: limit.__exit__(None, None, None))
    caplog.set_level(logging.WARNING, logger="tracetrain.engine")
    engines = []
    for layers in (1, 2, 3):
        torch.manual_seed(layers)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=layers, num_attention_heads=2)).eval()
        engines.append(decode_graph.DecodeGraph(model, compile=True))
        _step(engines[-1], 2)
        assert len(compiled) == len(runs) == layers, f"the {layers}-layer model's step ran eagerly"

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "tracetrain.engine"]

    assert all(e.fallback is None for e in engines) and not said()
    first, eager = engines[0], decode_graph.DecodeGraph(engines[0].runner, compile=False)
    torch.testing.assert_close(_step(first, 1), _step(eager, 1), rtol=0, atol=0)
    _step(first, 1)
    assert len(compiled) == len(runs) == 3  # eagerly, both
    assert "recompile_limit" in first.fallback and "runs eagerly" in first.fallback
    assert said() == [f"engine: {first.fallback}"]  # once
    for engine in engines:
        _step(engine, 2)
    assert len(compiled) == 3 and len(runs) == 6
    assert [e.fallback is None for e in engines] == [False, True, True]


def _hooked() -> LlamaForCausalLM:
    model = build_model(TOK, seed=1)
    model.lm_head.register_forward_hook(lambda m, i, out: out * 2)
    return model


@pytest.mark.parametrize("make,why", [
    (lambda: GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32)),
     "model_type 'gpt2'"),
    (lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 10000.0})), "RoPE type 'linear'"),
    (lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, hidden_act="gelu")), "activation 'gelu'"),
    (lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, attention_dropout=0.1)), "attention dropout 0.1"),
    (_hooked, "a forward hook on lm_head"),
])
def test_a_model_it_cannot_run_is_named(make, why):
    model = make()
    reason = decode_graph.unsupported(model)
    assert reason is not None and why in reason
    graph, note = decode_graph.build(model, compile=True)
    assert graph is None and why in note


def test_lora_decodes_through_transformers():
    import peft  # (the lora extra, which .ci/run installs)

    model = peft.get_peft_model(build_model(TOK, seed=1), peft.LoraConfig(target_modules=["q_proj"]))
    assert "LoRA" in decode_graph.unsupported(model)


def test_a_hooked_model_decodes_with_its_hook():
    """The engine of a model with a forward hook decodes through transformers, which runs it."""
    model = build_model(TOK, seed=1)
    no_eos = torch.zeros(len(TOK))
    no_eos[TOK.eos_token_id] = -1e4
    model.lm_head.register_forward_hook(lambda m, i, out: out + no_eos)
    engine = LocalEngine(model, TOK)
    assert engine.graph is None and "forward hook" in engine.graph_note
    gen = engine.generate_batch(_prompts()[:1], SamplingParams(max_tokens=60, seed=1))[0]
    assert TOK.eos_token_id not in gen.response_ids and len(gen.response_ids) == 60


def test_where_torch_compile_fails_the_step_runs_eagerly(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    reason = decode_graph.inductor_builds.__wrapped__()
    assert reason == "torch.compile failed: RuntimeError: no C++ compiler found"
    monkeypatch.setattr(decode_graph, "inductor_builds", lambda: reason)
    engine = LocalEngine(LLAMA, TOK, compile=True)
    assert not engine.graph.compiled and engine.graph.fn is decode_llama.decode_step
    assert engine.graph_note == f"one eager function ({reason})"
    params = SamplingParams(max_tokens=8, seed=3)
    plain = LocalEngine(LLAMA, TOK)
    assert ([g.response_ids for g in engine.generate_batch(_prompts(), params)]
            == [g.response_ids for g in plain.generate_batch(_prompts(), params)])


def test_inductor_caches_per_cpu_capability(monkeypatch):
    """torch 2.13 reuses a kernel its on-disk cache holds from a run under another
    ATEN_CPU_CAPABILITY (measured: a compiled decode gave id 511 at every step after an avx512 run
    had filled the cache, then an avx2 run read it): each capability gets a folder of its own,
    unless the user chose the folder."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    decode_graph._cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir() + "-avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/chosen")
    decode_graph._cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/chosen"
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    decode_graph._cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
