"""The decode's reserved KV cache (engines/kv_cache.py): the keys and values it holds are those
transformers' DynamicLayer holds after the same writes, whatever the writes, the row selections and
the crops; its stores grow when full and keep zeros past the written tokens; and a model's forward
over it gives the logits it gives over a DynamicCache."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tracetrain.engines.kv_cache import GROW, ReservedLayer, grown, reserve
from tracetrain.models.tiny import build_model, build_tokenizer

# ops on (a reserved layer, a DynamicLayer): ("write", n), ("select", rows), ("crop", length)
ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(1, 40)),
    st.tuples(st.just("select"), st.lists(st.integers(0, 7), min_size=1, max_size=4)),
    st.tuples(st.just("crop"), st.integers(-3, 60).filter(bool)),
), max_size=12)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 30), st.integers(0, 80), ops, st.integers(0, 2**31))
def test_a_reserved_layer_holds_what_a_dynamic_layer_holds(B, L, room, steps, seed):
    g = torch.Generator().manual_seed(seed)

    def kv(rows, n):
        return torch.randn(rows, 2, n, 3, generator=g), torch.randn(rows, 2, n, 3, generator=g)

    keys, values = kv(B, L)
    plain = DynamicLayer()
    plain.update(keys, values)
    reserved = ReservedLayer(keys, values, room)
    assert reserved._k.shape[-2] == L + room
    for op, arg in steps:
        rows = reserved.keys.shape[0]
        if op == "write":
            k, v = kv(rows, arg)
            columns, offset = reserved.get_mask_sizes(arg)  # asked before the write, as transformers does
            before = reserved._k.shape[-2]
            full_k, full_v = reserved.update(k, v)
            plain.update(k, v)
            n = reserved.get_seq_length()
            assert offset == 0 and full_k.shape[-2] == full_v.shape[-2] == columns >= n
            assert columns == (before if n <= before else grown(n))  # full: grown, not per token
            assert full_k[:, :, :n].equal(plain.keys) and full_v[:, :, :n].equal(plain.values)
            assert not full_k[:, :, n:].any() and not full_v[:, :, n:].any()  # zeros past them
        elif op == "select":
            idx = torch.tensor([r % rows for r in arg])
            reserved.batch_select_indices(idx)
            plain.batch_select_indices(idx)
        elif (arg if arg > 0 else plain.get_seq_length() + arg) >= 1:
            # (a crop to no tokens: DynamicLayer then keeps its rows through a selection)
            reserved.crop(arg)
            plain.crop(arg)
            assert not reserved._k[:, :, reserved.get_seq_length():].any()
        assert reserved.get_seq_length() == plain.get_seq_length()
        assert reserved.keys.equal(plain.keys) and reserved.values.equal(plain.values)


def test_a_full_store_grows_by_a_quarter_or_GROW_tokens():
    assert grown(100) == 100 + GROW and grown(1000) == 1250


def test_a_forward_over_a_reserved_cache_gives_the_logits_of_a_dynamic_cache():
    """The tiny model, 3 rows (one left-padded), a prefill then 5 decode steps: over the
    reserved cache (attention over its whole store, the columns past the tokens masked) each
    step's logits are the DynamicCache's within float32 rounding of the attention's sums
    (the same products; a reduction over more zero columns may be blocked differently:
    atol 1e-5 on logits of size ~1)."""
    tok = build_tokenizer()
    model = build_model(tok, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[2, :4] = 0
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True)
        plain = out.past_key_values
        copy = DynamicCache([(layer.keys.clone(), layer.values.clone()) for layer in plain.layers])
        reserved = reserve(copy, 2)  # (room for 2 tokens: it grows at the third step)
        assert all(isinstance(layer, ReservedLayer) for layer in reserved.layers)
        y, next_pos = out.logits[:, -1].argmax(-1), position[:, -1] + 1
        for _ in range(5):
            mask = torch.cat([mask, mask.new_ones(3, 1)], dim=-1)
            a = model(input_ids=y[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                      past_key_values=plain, use_cache=True).logits[:, -1]
            b = model(input_ids=y[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                      past_key_values=reserved, use_cache=True).logits[:, -1]
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
            y, next_pos = a.argmax(-1), next_pos + 1
        assert reserved.get_seq_length() == plain.get_seq_length() == 14
