"""The local engine's precision (engines/precision.py) and its decode attention
(engines/attention.py): grouped attention is eager attention's arithmetic; a bf16 engine serves
the model's weights rounded to bf16 (its logprobs as close to the fp32 model's as a plain bf16
forward's are), and takes them again on every announced change; fp32 shares the model's weights;
auto's choice is what it measured."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import eager_attention_forward

from tracetrain.config import ConfigError, build_config
from tracetrain.engines.attention import grouped_attention
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.engines.precision import pick
from tracetrain.models.tiny import build_model, build_tokenizer


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 4), K=st.integers(1, 3), G=st.integers(1, 4), L=st.integers(1, 20),
       d=st.sampled_from([4, 8, 16]), seed=st.integers(0, 2**31 - 1), masked=st.booleans())
def test_grouped_attention_is_eager_attention(B, K, G, L, d, seed, masked):
    """One query token per row, GQA with G query heads per kv head, an additive mask: the same
    output as transformers' eager attention (repeat_kv then matmuls). In float64 the two differ
    only by summation order: |diff| <= L * 2^-52 * max|v| ~ 1e-14 here; atol 1e-12."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, K * G, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, K, L, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, K, L, d, generator=g, dtype=torch.float64)
    mask = None
    if masked:  # left padding: each row's first keys masked (at least one key kept)
        pad = torch.randint(0, L, (B,), generator=g)
        keep = torch.arange(L)[None, :] >= pad[:, None]
        mask = torch.zeros(B, 1, 1, L, dtype=torch.float64)
        mask[~keep[:, None, None, :]] = torch.finfo(torch.float64).min
    module = types.SimpleNamespace(num_key_value_groups=G, training=False)
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    got, _ = grouped_attention(module, q, k, v, mask, scaling=d**-0.5)
    assert got.shape == want.shape == (B, 1, K * G, d)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def forced(model, prompt, response):
    """Logprobs of `response` after `prompt`: one forward pass, no KV cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def decode(engine, prompts):
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s)
              for s in range(len(prompts))]
    return engine.generate_batch(prompts, params)


def gaps(model, prompts, gens, *, ref=None):
    """|engine logprob - `model`'s teacher-forced logprob| over all tokens (ref: the same for
    `ref`'s logprobs in place of the engine's)."""
    out = []
    for p, g in zip(prompts, gens, strict=True):
        mine = torch.tensor(g.response_logprobs) if ref is None else forced(ref, p, g.response_ids)
        out.append((mine - forced(model, p, g.response_ids)).abs())
    return torch.cat(out)


PROMPTS = [[5 + (7 * i + 3 * j) % 200 for j in range(6 + 3 * i)] for i in range(4)]


def test_bf16_engine_serves_the_weights_rounded_to_bf16(tok):
    """The bf16 engine's logprobs differ from the fp32 model's (teacher-forced) by what a plain
    bf16 copy of the model computes (teacher-forced, transformers' own attention) differs by:
    rounding, of the same size (mean within 2x, max within 3x); the fp32 engine's by fp32
    rounding only (< 1e-4, as tests/engines/test_engine_local.py bounds it)."""
    model = build_model(tok, seed=0)
    plain = copy.deepcopy(model).to(torch.bfloat16)
    e16 = LocalEngine(model, tok, precision="bf16", seed=0)
    e32 = LocalEngine(model, tok, precision="fp32", seed=0)
    assert e16.precision == "bf16" and next(e16.runner.parameters()).dtype == torch.bfloat16
    assert e32.runner is not model and all(
        a is b for a, b in zip(e32.runner.parameters(), model.parameters(), strict=True))
    gens = decode(e16, PROMPTS)
    engine_gap, plain_gap = gaps(model, PROMPTS, gens), gaps(model, PROMPTS, gens, ref=plain)
    assert plain_gap.mean() > 1e-4  # (bf16 rounding is visible at this size)
    assert engine_gap.mean() <= 2 * plain_gap.mean()
    assert engine_gap.max() <= 3 * plain_gap.max()
    assert gaps(model, PROMPTS, decode(e32, PROMPTS)).max() < 1e-4


def test_bf16_engine_takes_new_weights_when_told(tok):
    """Weights changed in place and announced (update_weights(None, v)), or loaded
    (update_weights(state_dict, v)): the bf16 engine's logprobs follow the new weights (a gap of
    bf16 rounding to them, far below the change's own effect on the logprobs)."""
    model = build_model(tok, seed=0)
    old = copy.deepcopy(model)
    engine = LocalEngine(model, tok, precision="bf16", seed=0)
    before = gaps(model, PROMPTS, decode(engine, PROMPTS))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * p.std())
    engine.update_weights(None, 1)
    gens = decode(engine, PROMPTS)
    assert all(g.model_version == 1 for g in gens)
    moved = gaps(old, PROMPTS, gens)  # the change's effect on the logprobs
    assert moved.mean() > 20 * before.mean()
    assert gaps(model, PROMPTS, gens).mean() <= 2 * before.mean()
    engine.update_weights(old.state_dict(), 2)  # loaded back: the old weights again
    assert gaps(old, PROMPTS, decode(engine, PROMPTS)).mean() <= 2 * before.mean()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_lm_head_gets_contiguous_rows_in_a_prefill(tok, precision):
    """A prefill's last positions (hidden[:, -1:] of [B, S, h], a strided view) reach the engine's
    lm head dense, their leading dimensions foldable into one (torch's matmul would otherwise
    expand and copy the weight: precision.py), for a batch of prompts and for one prompt alone
    (a [1, 1, h] slice is contiguous with batch stride S*h); the user's model is left without the
    hook."""
    model = build_model(tok, seed=0)
    engine = LocalEngine(model, tok, precision=precision, seed=0)
    seen = []

    def dense(x):
        return all(x.stride(i) == x.stride(i + 1) * x.size(i + 1) for i in range(x.dim() - 1))

    engine.runner.get_output_embeddings().register_forward_pre_hook(
        lambda m, args: seen.append((args[0].shape[0], dense(args[0]))))
    decode(engine, PROMPTS)
    decode(engine, [[9, 8, 7, 6, 5, 4, 3, 2]])  # one new prompt: its whole head is forwarded
    assert {b for b, _ in seen} >= {1, len(PROMPTS)} and all(ok for _, ok in seen)
    assert not model.get_output_embeddings()._forward_pre_hooks


def test_auto_runs_what_it_measured_faster(tok):
    """auto: the runner is the bf16 copy exactly when its measured decode step was >= 10 %
    faster (pick), else the fp32 runner on the model's weights."""
    model = build_model(tok, seed=0)
    engine = LocalEngine(model, tok, precision="auto", seed=0)
    seconds = engine.precision_s
    assert set(seconds) == {"fp32", "bf16"} and all(s > 0 for s in seconds.values())
    assert engine.precision == pick(seconds, 0.1)
    dtype = next(engine.runner.parameters()).dtype
    assert dtype == (torch.bfloat16 if engine.precision == "bf16" else torch.float32)
    assert pick({"fp32": 1.0, "bf16": 0.9}, 0.1) == "bf16"
    assert pick({"fp32": 1.0, "bf16": 0.91}, 0.1) == "fp32"


def test_precision_key():
    """engine.precision takes fp32, bf16 and auto (fp32 by default); another value names the key;
    a vLLM engine has no such key (its server's dtype is its own)."""
    assert build_config({}).engine.precision == "fp32"
    assert build_config({"engine": {"precision": "auto"}}).engine.precision == "auto"
    with pytest.raises(ConfigError, match="'engine.precision'"):
        build_config({"engine": {"precision": "fp16"}})
    with pytest.raises(ConfigError, match="'engine.precision'"):
        build_config({"engine": {"kind": "vllm", "python": "/usr/bin/python3", "precision": "bf16"}})
    with pytest.raises(ValueError, match="precision must be one of"):
        LocalEngine(build_model(build_tokenizer(), num_layers=1), build_tokenizer(), precision="fp16")
