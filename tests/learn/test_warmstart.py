"""Warm start: transcripts render with the chat template, and a few supervised steps lower the loss."""

from __future__ import annotations

import torch

from tracetrain.learn.warmstart import pad_batch, render, warm_start
from tracetrain.models import tiny


def test_render_matches_the_chat_template_and_pads_right():
    tok = tiny.build_tokenizer()
    convo = [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "5"}]
    other = [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "17"}]
    a, b, c = render(tok, [convo, other, convo])
    direct = tok.apply_chat_template(convo, tokenize=True, add_generation_prompt=False)
    assert a == list(direct["input_ids"] if hasattr(direct, "keys") else direct) == c
    assert a != b
    ids, mask = pad_batch([a, b], pad_id=0)
    assert ids.shape == (2, max(len(a), len(b)))
    assert ids[0, : len(a)].tolist() == a and mask[0].sum() == len(a) and mask[1].sum() == len(b)


def test_supervised_steps_lower_the_loss():
    torch.manual_seed(0)
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    games = [[{"role": "user", "content": "Guess."}, {"role": "assistant", "content": str(k % 8 + 1)}]
             for k in range(32)]
    losses = warm_start(model, tok, games, steps=30, batch_size=16, lr=1e-2)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert not model.training
