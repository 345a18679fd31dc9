"""LoRA (tracetrain/models/lora.py, peft) on the tiny model: the adapter's gradient is the full model's
gradient projected on it, the per-rollout loss stays split-invariant, only the adapter changes and
is checkpointed, save -> load and the merged policy give the same logprobs, the local engine
decodes with the updated adapter in place, and a run trains, checkpoints and resumes."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracetrain.config import ConfigError, LoraConfig, build_config
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.learn.logprobs import response_logprobs
from tracetrain.learn.optim import adamw
from tracetrain.models import lora
from tracetrain.models.tiny import build_model, build_tokenizer
from tracetrain.objective.loss import policy_loss
from tracetrain.objective.weights import RowWeights, row_scales
from tracetrain.rows.aggregate import aggregate
from tracetrain.types import Rollout, Turn

TARGETS = ["q_proj", "v_proj", "down_proj"]
ADV = torch.tensor([1.0, -0.3, 0.5, 0.2])  # per rollout


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def lora_model(tok, seed=0, r=4, alpha=8.0):
    model = build_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=seed)
    pm = lora.wrap(model, LoraConfig(r=r, alpha=alpha, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # seeded here (peft draws A from the global RNG); B starts at zero
        for name, p in pm.named_parameters():  # (W' = W): make the adapter do something
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return pm


def batch_of(tok, rollouts, level="trajectory"):
    batch, _ = aggregate(rollouts, level=level, max_prompt_length=64, max_response_length=32,
                         pad_token_id=tok.pad_token_id or 0)
    return batch


def rollouts_of(seed: int, n: int = 4, turns: int = 2) -> list[Rollout]:
    """Multi-turn rollouts whose turns continue each other (one row at trajectory level, one row
    per turn at transition level)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        prompt = (torch.randint(3, 200, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)).tolist()
        rollout_turns, context = [], list(prompt)
        for _ in range(turns):
            length = int(torch.randint(1, 5, (1,), generator=g))
            response = torch.randint(3, 200, (length,), generator=g).tolist()
            rollout_turns.append(Turn(list(context), response, [-1.0] * len(response)))
            context += response + torch.randint(3, 200, (2,), generator=g).tolist()
        out.append(Rollout(f"r{k}", f"g{k // 2}", rollout_turns, reward=float(k % 2)))
    return out


def loss_of(model, batch, adv_by_rollout, mode="rollout-mean"):
    lp, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                              batch.response_length)
    ids = [f"r{int(i)}" for i in batch.rollout_index]
    weights = RowWeights(batch.response_mask, row_scales(batch.response_mask, ids, mode=mode))
    old = torch.where(batch.response_mask.bool(), lp.detach() - 0.05, torch.zeros(()))
    loss, _ = policy_loss(lp, old, adv_by_rollout[batch.rollout_index], weights)
    return loss


def test_adapter_gradient_is_the_full_gradient_projected_on_it(tok):
    """With W' = W + s B A (s = alpha / r): dL/dB = s (dL/dW') A^T and dL/dA = s B^T (dL/dW')."""
    pm = lora_model(tok)
    batch = batch_of(tok, rollouts_of(0))
    loss_of(pm, batch, ADV).backward()
    merged = lora.merged(pm)
    for p in merged.parameters():
        p.requires_grad_(True)
    loss_of(merged, batch, ADV).backward()
    s = 8.0 / 4
    full = dict(merged.named_parameters())
    checked = 0
    for name, module in pm.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
        G = full[name.removeprefix("base_model.model.") + ".weight"].grad
        torch.testing.assert_close(B.grad, s * G @ A.detach().T, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(A.grad, s * B.detach().T @ G, rtol=1e-4, atol=1e-6)
        checked += 1
    assert checked == 2 * 3  # 2 layers x 3 target modules


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["rollout-mean", "token-mean"]),
       turns=st.integers(1, 3))
def test_loss_and_adapter_gradient_do_not_depend_on_how_rollouts_are_cut(tok, seed, mode, turns):
    """The same rollouts as one row each (trajectory level) and as one row per turn
    (transition level): the same loss and the same adapter gradient."""
    rollouts = rollouts_of(seed, turns=turns)
    grads = []
    for level in ("trajectory", "transition"):
        pm = lora_model(tok, seed=7)
        batch = batch_of(tok, rollouts, level)
        assert batch.input_ids.shape[0] == (4 if level == "trajectory" else 4 * turns)
        loss = loss_of(pm, batch, ADV, mode)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in pm.named_parameters()
                                      if p.requires_grad}))
    (l0, g0), (l1, g1) = grads
    # one row per rollout or one per turn: the same fp32 terms in other matmul shapes and sum
    # orders (<~ 100 u = 6e-6 relative for the adapter's gradients, a few u for the loss)
    torch.testing.assert_close(l0, l1, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and all("lora_" in n for n in g0)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-4, atol=1e-6)


def test_an_update_changes_only_the_adapter_and_the_engine_decodes_with_it(tok):
    pm = lora_model(tok)
    base = {n: p.detach().clone() for n, p in pm.named_parameters() if not p.requires_grad}
    adapter = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    engine = LocalEngine(pm, tok)  # the same module: nothing copied
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=6, seed=3)
    before = engine.generate_batch([prompt], params)[0]
    opt = adamw(lora.trainable(pm), lr=0.05, weight_decay=0.0)
    loss_of(pm, batch_of(tok, rollouts_of(1)), ADV).backward()
    opt.step()
    # the new version, as the trainer's sync says it: the engine's prefix cache is dropped
    engine.update_weights(None, 1)
    assert all(torch.equal(p, base[n]) for n, p in pm.named_parameters() if n in base)
    assert any(not torch.equal(p, adapter[n]) for n, p in pm.named_parameters() if n in adapter)
    after = engine.generate_batch([prompt], params)[0]
    ids = torch.tensor([prompt + after.response_ids])
    R = len(after.response_ids)
    recomputed, _ = response_logprobs(pm, ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], R)
    torch.testing.assert_close(torch.tensor(after.response_logprobs), recomputed[0], rtol=1e-4, atol=1e-5)
    ids0 = torch.tensor([prompt + before.response_ids])
    stale, _ = response_logprobs(pm, ids0, torch.ones_like(ids0), torch.arange(ids0.shape[1])[None],
                                 len(before.response_ids))
    assert not torch.allclose(torch.tensor(before.response_logprobs), stale[0], atol=1e-4)


def test_saved_adapter_merged_policy_and_peft_directory_give_the_same_logprobs(tok, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tracetrain.models.save import write_hf_dir

    pm = lora_model(tok, seed=4)
    state = lora.weights(pm)
    assert state and all("lora_" in k for k in state)  # the adapter alone
    fresh = lora.wrap(build_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=4),
                      LoraConfig(r=4, alpha=8.0, target_modules=TARGETS))
    lora.load_weights(fresh, state)
    write_hf_dir(lora.merged(pm), tok, tmp_path / "policy")
    pm.save_pretrained(tmp_path / "policy" / "adapter")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    base = build_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=4)
    from_dir = PeftModel.from_pretrained(base, tmp_path / "policy" / "adapter").eval()
    batch = batch_of(tok, rollouts_of(2))
    want = response_logprobs(pm.eval(), batch.input_ids, batch.attention_mask, batch.position_ids,
                             batch.response_length)[0]
    for model in (fresh.eval(), loaded, from_dir):
        got = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                batch.response_length)[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="lacks"):
        lora.load_weights(fresh, {"base_model.model.nope.lora_A.weight": torch.zeros(1)})


def test_lora_config_errors_name_the_key(tok):
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        lora.wrap(build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1),
                  LoraConfig(target_modules=["no_such_proj"]))
    with pytest.raises(ConfigError, match="model.lora.*trainer.collect 'overlap'"):
        build_config({}, ["model.lora.r=4", "trainer.collect=overlap", "trainer.max_staleness=1"])
    with pytest.raises(ConfigError, match="model.lora.*engine.base_url"):  # (tests/engines/test_lora_vllm.py)
        build_config({}, ["model.lora.r=4", "engine.kind=vllm", "engine.base_url=http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="model.lora.*backend"):
        build_config({}, ["model.lora.r=4", "backend=verl", "model.kind=pretrained", "model.path=/m"])
    with pytest.raises(ConfigError, match="model.lora.r"):
        build_config({}, ["model.lora.r=0"])


@pytest.mark.slow
def test_a_lora_run_trains_the_adapter_checkpoints_it_and_resumes(tmp_path):
    """The guess demo, small, with LoRA: only adapter weights in the checkpoint, policy/ holds
    the merged model and the adapter, and 2 steps + resume 1 step equal 3 steps straight."""
    from test_train_e2e import EXAMPLE, read_metrics, small_config

    from tracetrain.run.trainer import train

    lora_keys = {"model.lora.r": 4, "model.lora.target_modules": '["q_proj","v_proj"]',
                 "trainer.collect": "step", "trainer.eval_every": 0}
    run = tmp_path / "run"
    train(small_config(run, 2, **lora_keys), base_dir=EXAMPLE, log=lambda *_: None)
    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["model"] and all("lora_" in k for k in ck["model"])
    assert any(float(v.abs().sum()) > 0 for k, v in ck["model"].items() if "lora_B" in k)
    assert (run / "policy" / "model.safetensors").is_file()
    assert json.loads((run / "policy" / "adapter" / "adapter_config.json").read_text())["r"] == 4
    train(small_config(run, 3, **lora_keys, **{"trainer.resume": "true"}), base_dir=EXAMPLE,
          log=lambda *_: None)
    straight = tmp_path / "straight"
    train(small_config(straight, 3, **lora_keys), base_dir=EXAMPLE, log=lambda *_: None)
    a, b = read_metrics(run), read_metrics(straight)
    assert [m["step"] for m in a] == [0, 1, 2]
    for x, y in zip(a, b, strict=True):
        assert x["reward_mean"] == y["reward_mean"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-6)


def test_a_fresh_adapter_decodes_in_eval_mode(tok):
    """With adapter dropout, a freshly wrapped policy is in eval mode: the engine's first rollouts
    are drawn without dropout, and two scorings of the same tokens agree."""
    model = lora.wrap(build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  seed=0), LoraConfig(dropout=0.5))
    assert not any(m.training for m in model.modules())
    with torch.no_grad():  # a trained adapter (a fresh one's B is 0: dropout would not show)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
        assert torch.equal(model(ids).logits, model(ids).logits)
        model.train()  # the control: in training mode the adapter's dropout draws anew
        assert not torch.equal(model(ids).logits, model(ids).logits)


def test_merged_is_a_copy_and_plain_models_pass_through(tok):
    pm = lora_model(tok)
    merged = lora.merged(pm)
    assert not lora.is_lora(merged) and lora.is_lora(pm)  # the policy keeps its adapter
    plain = build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    assert lora.merged(plain) is plain and lora.trainable(plain) == list(plain.parameters())
    assert lora.weights(plain).keys() == plain.state_dict().keys()
