"""Warm start: a short supervised phase on example transcripts before RL.

Loss = mean next-token cross-entropy over every real token of each transcript rendered with the
chat template (the environment's replies included: a tiny model first has to learn the format).
"""

from __future__ import annotations

import json
import random

import torch
import torch.nn.functional as F

from tracetrain.learn.optim import adamw, clip_grad_norm


def render(tokenizer, transcripts: list[list[dict]]) -> list[list[int]]:
    """Chat transcripts -> token ids with the model's chat template (each distinct one rendered once:
    the template is Jinja, and warm-start games repeat)."""
    cache: dict[str, list[int]] = {}
    out = []
    for messages in transcripts:
        key = json.dumps(messages, sort_keys=True)
        if key not in cache:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            cache[key] = list(ids)
        out.append(cache[key])
    return out


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest; returns (input_ids, attention_mask)."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def warm_start(
    model,
    tokenizer,
    transcripts: list[list[dict]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    precision: str = "fp32",
) -> list[float]:
    """Train `model` in place for `steps` AdamW updates; returns the loss of each step.
    `precision`: as in `tracetrain.learn.logprobs.autocast`."""
    from tracetrain.learn.logprobs import autocast

    seqs = render(tokenizer, transcripts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng = random.Random(seed)
    opt = adamw(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        ids, mask = pad_batch(rng.sample(seqs, min(batch_size, len(seqs))), pad_id)
        device = next(model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        with autocast(precision, ids.device):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses
