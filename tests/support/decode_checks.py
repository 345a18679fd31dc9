"""The one-function decode step (engines/decode_graph.py) against transformers' forward, step by
step, for tests/engines/test_decode_graph.py and test_decode_graph_families.py."""

from __future__ import annotations

import torch

from tracetrain.engines.kv_cache import reserve
from tracetrain.engines.layers import empty_cache, layer_kinds


def prefill(runner, ids, mask):
    """transformers' forward over the prompts into the engine's cache (every token of a sliding
    layer kept: engines/layers.py)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = runner(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                 past_key_values=empty_cache(layer_kinds(runner)))
    return out.past_key_values, positions[:, -1]


@torch.inference_mode()
def compare(graph, lengths, steps, room, seed) -> list[torch.Tensor]:
    """Decode `steps` random tokens after left-padded random prompts of `lengths`, by transformers'
    forward and by `graph` over copies of one prefill: the same logits and KV, bit for bit, at
    every step (asserted); each step's logits."""
    runner = graph.runner
    g = torch.Generator().manual_seed(seed)
    vocab, B, L = runner.config.vocab_size, len(lengths), max(lengths)
    ids = torch.randint(1, vocab, (B, L), generator=g)
    mask = torch.zeros(B, L, dtype=torch.int64)
    for b, n in enumerate(lengths):  # left padding
        mask[b, L - n :] = 1
    (theirs, pos), (ours, _) = prefill(runner, ids, mask), prefill(runner, ids, mask)
    theirs, ours = reserve(theirs, room), reserve(ours, room)  # (room < steps: the stores grow)
    out = []
    for _ in range(steps):
        y = torch.randint(1, vocab, (B, 1), generator=g)
        mask, pos = torch.cat([mask, mask.new_ones(B, 1)], -1), pos + 1
        want = runner(input_ids=y, attention_mask=mask, position_ids=pos[:, None],
                      past_key_values=theirs, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        got, _ = graph(y, mask, pos[:, None], ours)
        assert torch.equal(got, want)
        for a, b in zip(ours.layers, theirs.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        out.append(got)
    return out
