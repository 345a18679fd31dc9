"""A real tiny causal LM (Qwen2 built from a config, random weights) and rows laid out like a
TrainingBatch, for the loss / partition / distributed tests (helpers for test_loss, test_minibatch,
test_distributed). `one_torch_thread` is an autouse fixture only in the test files that import it
by name."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 64


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model's ops are small: one torch thread is faster for them, and does not stall
    when the machine's cores are shared (a 2-thread op waits for its slower half)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_causal_lm(seed: int = 0) -> Qwen2ForCausalLM:
    """hidden 32, 2 layers, vocab 64; fp32, eager attention, same weights for the same seed."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def make_rows(rows_per_rollout: list[int], *, P: int = 6, R: int = 10, seed: int = 0) -> dict:
    """Random rows in the TrainingBatch layout: left-padded prompts, right-padded responses, a
    response mask over a random subset of the real response tokens, rows of a rollout adjacent."""
    g = torch.Generator().manual_seed(seed)
    n = sum(rows_per_rollout)
    input_ids = torch.zeros(n, P + R, dtype=torch.int64)
    attention_mask = torch.zeros(n, P + R, dtype=torch.int64)
    response_mask = torch.zeros(n, R, dtype=torch.bool)
    for i in range(n):
        p = int(torch.randint(1, P + 1, (1,), generator=g))
        r = int(torch.randint(1, R + 1, (1,), generator=g))
        input_ids[i, P - p : P + r] = torch.randint(1, VOCAB, (p + r,), generator=g)
        attention_mask[i, P - p : P + r] = 1
        response_mask[i, :r] = torch.rand(r, generator=g) < 0.7
    rollout_index = torch.repeat_interleave(
        torch.arange(len(rows_per_rollout)), torch.tensor(rows_per_rollout)
    )
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_index": rollout_index,
    }


def logprobs_and_entropy(model, rows: dict, index: torch.Tensor | None = None):
    """Per-token log-probability of each response token, and the entropy of its distribution."""
    ids, am, pos = rows["input_ids"], rows["attention_mask"], rows["position_ids"]
    if index is not None:
        ids, am, pos = ids[index], am[index], pos[index]
    R = rows["response_mask"].shape[1]
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits
    logp = logits[:, -R - 1 : -1].float().log_softmax(-1)  # position j predicts token j + 1
    lp = logp.gather(-1, ids[:, -R:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy
