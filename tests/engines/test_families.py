"""Every model family serves and trains: a matrix over tiny random models (tests/support/
families.py) of the families the local engine serves, sliding-window (gemma2, gemma3_text,
mistral, gpt_oss: windows of 16 tokens under prompts of 39-66 tokens), MoE (qwen3_moe, gpt_oss),
fused projections (phi3) and conv layers (lfm2) among them.

For each family the local engine's tokens and logprobs are transformers' own forward pass over the
prompt and the response (teacher forcing: no cache, no padding), with and without the prefix
cache, for prompts that share prefixes (rows with masked columns between their tokens), for a
later batch that reads those prefixes from the cache, and for requests that join a running
batch; LoRA with the default targets adapts the family's projections and trains the adapter
alone; and two steps of the real run train with no failed rollout, each rollout's loss mass 1/R
and the trainer's logprobs the engine's.

Tolerances. Engine and reference run the same fp32 weights on other shapes (a KV cache, a
left-padded batch, a prefix computed in another pass), so each logit differs by the reassociation
of its sums: a sum of n terms moves by <~ n u |sum| at worst and ~ sqrt(n) u |sum| typically
(u = 2^-24), with n <= 3 x (64 + 128) terms on a logit's path through these models' 2-3 layers
of hidden 64 and MLP 128, and |logits| < 4: ~1e-5 typically; log_softmax adds a few u.
LOGPROB_ATOL 1e-4 on a logprob is 10x that (measured <= 3e-6, 30x under it). A greedy token is
the reference's argmax, or (a near tie) within 2 LOGPROB_ATOL of its logit; after a near tie
the two continuations part and are not compared.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers as tf
from families import FAMILIES, TOK, WINDOW, family_model
from joining import with_late_requests

from tracetrain.config import ConfigError, LoraConfig, build_config
from tracetrain.engines.attention import engine_mask
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.models import lora
from tracetrain.models.tiny import save_tiny
from tracetrain.run.trainer import train

KINDS = list(FAMILIES)
LOGPROB_ATOL = 1e-4
GUESS = Path(__file__).resolve().parents[2] / "examples" / "guess"
SYSTEM = [{"role": "system", "content": "You are playing a game. Reply with the number only."}]


def _chat(*users: str) -> list[int]:
    msgs = SYSTEM + [{"role": "user", "content": u} for u in users]
    return TOK.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]


# a shared system prompt, rests of other lengths, and a prompt shorter than the window
PROMPTS = [_chat("Guess."), _chat("Guess a number between one and a hundred, please, quickly."),
           _chat("Higher. Guess again."), [5, 6, 7]]
NEXT = TOK.apply_chat_template([{"role": "user", "content": "Lower."}],
                               add_generation_prompt=True)["input_ids"]  # (a later turn's)


@pytest.fixture(autouse=True)
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models() -> dict:
    return {}


def model_of(models: dict, kind: str) -> torch.nn.Module:
    if kind not in models:
        models[kind] = family_model(kind)
    return models[kind]


@torch.no_grad()
def reference_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """transformers' forward over prompt + response: the logits [R, V] that chose each response
    token."""
    return model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()


def check_generation(model, prompt: list[int], gen, temperature: float) -> None:
    """`gen`'s logprobs are the reference's; greedy: its tokens the reference's argmax (module
    docstring: up to a near tie)."""
    logits = reference_logits(model, prompt, gen.response_ids)
    ids = torch.tensor(gen.response_ids)
    scaled = logits / temperature if temperature > 0 else logits
    expected = torch.log_softmax(scaled, -1).gather(-1, ids[:, None]).squeeze(-1)
    got = torch.tensor(gen.response_logprobs)
    n = len(ids)
    if temperature == 0:
        for t in range(n):
            gap = float(logits[t].max() - logits[t, ids[t]])
            assert gap <= 2 * LOGPROB_ATOL, f"token {t}: not the argmax (by {gap})"
            if gap > 0 and int(logits[t].argmax()) != int(ids[t]):
                n = t + 1  # a near tie: the continuations part here
                break
    torch.testing.assert_close(got[:n], expected[:n], atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_and_logprobs_are_transformers_own_with_and_without_the_prefix_cache(models, kind,
                                                                                      caplog):
    model = model_of(models, kind)
    assert max(map(len, PROMPTS)) > 2 * WINDOW  # (the windows slide)
    with caplog.at_level(logging.WARNING, logger="tracetrain.engine"):
        engines = [LocalEngine(model, TOK, prefix_cache=c, seed=0) for c in (False, True)]
    said = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert said == ([f"local engine 'local': model_type {kind!r} has conv layers, whose state at "
                     "the end of a prefix is not a slice of its tokens: prompts are prefilled "
                     "whole, without the prefix cache"] if kind == "lfm2" else [])
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    for eng in engines:
        first = eng.generate_batch(PROMPTS, greedy)
        for prompt, gen in zip(PROMPTS, first, strict=True):
            check_generation(model, prompt, gen, 0.0)
        # a later turn of each conversation (its prefix cached) and a group of 2, sampled
        later = [p + g.response_ids + NEXT for p, g in zip(PROMPTS[:2], first[:2], strict=True)
                 ] + [PROMPTS[2]] * 2
        for prompt, gen in zip(later, eng.generate_batch(later, SamplingParams(
                max_tokens=8, temperature=1.0, seed=11)), strict=True):
            check_generation(model, prompt, gen, 1.0)
    cached = engines[1].stats["prefix_cache_tokens"]
    assert cached == 0 if kind == "lfm2" else cached > len(PROMPTS[0])


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_that_joins_a_running_batch_gets_transformers_own_tokens(models, kind):
    model = model_of(models, kind)
    first = (PROMPTS[1], SamplingParams(max_tokens=24, seed=5))
    late = [(PROMPTS[0] + [7], SamplingParams(max_tokens=6, seed=1)),
            (PROMPTS[3], SamplingParams(max_tokens=8, seed=2))]
    eng = LocalEngine(model, TOK, batch_window_ms=1.0)
    head, gens = with_late_requests(eng, first, late, [2, 5])
    assert eng.stats["joined"] == 2 and eng.stats["batches"] == 1
    alone = LocalEngine(model, TOK, prefix_cache=False)
    for (prompt, params), gen in zip([first, *late], [head, *gens], strict=True):
        assert gen.response_ids == alone.generate_batch([prompt], params)[0].response_ids
        check_generation(model, prompt, gen, 1.0)


@pytest.mark.parametrize("kind", KINDS)
def test_lora_default_targets_adapt_the_projections_and_train_the_adapter_alone(kind):
    model = family_model(kind, seed=1)
    expected = {"phi3": ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"],
                "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
                "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj"],  # (experts: not linear)
                "lfm2": ["in_proj", "out_proj", "w1", "w3", "w2", "q_proj", "k_proj", "v_proj"]}
    targets = lora.default_targets(model)
    assert targets == expected.get(kind, [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - 1  # (less the head)
    pm = lora.wrap(model, LoraConfig(r=4))
    adapted = [n.split(".")[-2] for n, _ in pm.named_modules() if n.endswith(".base_layer")]
    assert set(adapted) == set(targets) and len(adapted) == linear  # every projection
    # the engine decodes with the adapter (B random: not the base's logprobs)
    for p in lora.trainable(pm):
        torch.nn.init.normal_(p, std=0.05)
    gen = LocalEngine(pm, TOK).generate_batch(PROMPTS[:1], SamplingParams(max_tokens=4, seed=3))[0]
    check_generation(pm, PROMPTS[0], gen, 1.0)
    pm.train()
    ids = torch.tensor([PROMPTS[0]])
    pm(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in pm.named_parameters()}
    assert all(g is None for n, g in grads.items() if "lora_" not in n)
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_" in n)


@pytest.mark.parametrize("kind", ["llama", "phi3", "gpt_oss"])
def test_a_lora_target_that_matches_no_module_is_refused_naming_the_key(kind):
    with pytest.raises(ConfigError, match=r"config key 'model.lora.target_modules': 'nope_proj'"):
        lora.wrap(family_model(kind), LoraConfig(target_modules=["o_proj", "nope_proj"]))
    with pytest.raises(ConfigError, match=r"config key 'policies.b1.lora.target_modules': 'w9'"):
        lora.wrap_policies(family_model(kind), {"a1": LoraConfig(),
                                                "b1": LoraConfig(target_modules=["w9"])})


def test_a_model_the_engine_cannot_serve_is_refused_when_the_engine_is_made():
    model = family_model("qwen3")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="cannot serve model_type 'qwen3': layers of kind "
                                         "'linear_attention'"):
        LocalEngine(model, TOK)
    model = family_model("llama")
    model.config.attention_chunk_size = 8
    with pytest.raises(ValueError, match="cannot serve model_type 'llama': chunked attention"):
        LocalEngine(model, TOK)
    # a recurrent model: no layer kinds in its config, and its forward keeps no KV cache
    rwkv = tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=len(TOK), hidden_size=32, num_hidden_layers=2,
                                            attention_hidden_size=32, intermediate_size=64))
    with pytest.raises(ValueError, match="cannot serve model_type 'rwkv': its forward pass does "
                                         "not keep its state in the cache"):
        LocalEngine(rwkv.eval(), TOK, max_context=64)


def test_a_sliding_window_is_counted_in_positions_across_masked_columns():
    """engines/attention.py's mask: row 0 has masked columns between its tokens (a cached prefix,
    then the rest of its prompt), row 1 none; each query sees the keys of the `window` positions
    up to its own, whatever columns lie between them."""
    real = torch.tensor([[1, 1, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    got = engine_mask(2, 3, 7, q_offset=4, attention_mask=real, local_size=3,
                      dtype=torch.float32)[:, 0] == 0
    positions = real.long().cumsum(-1) - 1
    for b in range(2):
        for i, q in enumerate(range(4, 7)):
            want = [bool(real[b, k]) and k <= q and positions[b, q] - positions[b, k] < 3
                    for k in range(7)]
            assert got[b, i].tolist() == want
    # column 5 holds position 3: it sees positions 1-3, columns 1, 4 and 5 (by columns: 3-5)
    assert got[0, 1].tolist() == [False, True, False, False, True, True, False]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    return {kind: save_tiny(root / kind, TOK, family_model(kind, eos=True)) for kind in KINDS}


@pytest.mark.parametrize("adapter", [True, False], ids=["lora", "whole"])
@pytest.mark.parametrize("kind", KINDS)
def test_two_steps_of_the_real_run_train_every_family(saved, kind, adapter, tmp_path):
    """The guess demo on the family's model (LoRA with the default targets, or every weight); an
    entropy bonus gives each step a gradient (the untrained model's rewards are all 0)."""
    run_dir = tmp_path / "run"
    cfg = build_config({"task_args": {"high": 4, "max_turns": 2}}, [
        "task=task.py", "model.kind=pretrained", f"model.path={saved[kind]}",
        *(["model.lora.r=4"] if adapter else []),
        "rollout.tasks_per_step=2", "rollout.n_per_task=2", "rollout.max_tokens=3",
        "rollout.timeout_s=60", "optim.lr=1e-2", "optim.warmup_steps=0", "trainer.steps=2",
        "loss.entropy_coef=0.01", "trainer.eval_every=0", "trainer.seed=3",
        "trainer.checkpoint_minutes=0", f"trainer.run_dir={run_dir}"])
    train(cfg, base_dir=GUESS, log=lambda *_: None)
    ms = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in ms] == [0, 1] and [m["model_version"] for m in ms] == [1, 2]
    for m in ms:
        assert m["n_failed"] == 0 and m["n_timed_out"] == 0
        assert m["loss/rollout_mass_x_R_min"] == pytest.approx(1.0, abs=1e-6)
        assert m["loss/rollout_mass_x_R_max"] == pytest.approx(1.0, abs=1e-6)
        assert torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0
        # the trainer's logprobs of the sampled tokens (before the step's update) are the engine's
        assert m["engine/logprob_gap_max"] < LOGPROB_ATOL
