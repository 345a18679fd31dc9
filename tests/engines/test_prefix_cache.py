"""The local engine's radix tree of prefix KV (engines/prefix_cache.py, engines/prefill.py): the
same tokens and logprobs as without it, a hit for every prefix an earlier batch computed (per
adapter), nothing kept across new weights, at most its budget kept, least recently used out."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracetrain.config import LoraConfig
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.engines.prefix_cache import PrefixCache
from tracetrain.models import lora
from tracetrain.models.tiny import build_model, build_tokenizer

# Cached vs not: the same fp32 model, but a prefix's KV computed in another forward pass (other
# matmul shapes, other padding) than the row's own: a CPU-dependent reduction order. This model
# (hidden 32, intermediate 96, 2 layers; |logit| < 0.81 on random ids) carries per logit <~
# 2 * (32 + 96) u ~ 1.5e-5 of relative error in the worst case (u = 2^-24 per operation, the dot
# products' lengths summed over the blocks), ~1.2e-5 absolute; a logprob (a logit less the
# logsumexp) at most twice that, ~2.5e-5: atol 1e-4 has ~4x room over that bound. Measured: <=
# 9.6e-7 (vs no cache and vs teacher forcing) on an AMD EPYC (Zen 4) under ATEN_CPU_CAPABILITY=
# default, avx2, avx512 with 1 and 2 torch threads.
LOGPROB_ATOL = 1e-4
TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, seed=0, **TINY)


@pytest.fixture(scope="module")
def two_policies(tok):
    """Two LoRA adapters whose B is not zero: rows of one adapter get other KV than the other's."""
    m = lora.wrap_policies(build_model(tok, seed=1, **TINY),
                           {"p1": LoraConfig(r=2, alpha=4), "p2": LoraConfig(r=2, alpha=4)})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def teacher_forced(model, prompt, response, adapter=None):
    """Logprobs of `response` after `prompt` from one unpadded forward pass (no KV cache)."""
    extra = {} if adapter is None else {"adapter_names": [adapter]}
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response]), **extra).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


ids = st.lists(st.integers(3, 350), min_size=1, max_size=14)


@st.composite
def prefix_sharing_batches(draw, adapters):
    """Batches of prompts system + question (+ a later turn), groups repeating one prompt, some
    prompts seen in earlier batches, some extending them (an agent's next turn)."""
    systems = draw(st.lists(st.lists(st.integers(3, 350), max_size=20), min_size=1, max_size=3))
    questions = draw(st.lists(ids, min_size=1, max_size=4))
    turns = draw(st.lists(ids, min_size=1, max_size=2))
    batches = []
    for _ in range(draw(st.integers(1, 4))):
        batch = []
        for _ in range(draw(st.integers(1, 3))):  # groups
            prompt = draw(st.sampled_from(systems)) + draw(st.sampled_from(questions))
            if draw(st.booleans()):
                prompt = prompt + draw(st.sampled_from(turns))
            adapter = draw(st.sampled_from(adapters))
            batch += [(prompt, adapter)] * draw(st.integers(1, 3))
        batches.append(batch)
    return batches


def expected_hits(batches):
    """Per batch, the prompt tokens an unbounded cache answers: for each row, the longest common
    prefix of its head (prompt less its last token) with an earlier batch's head, same adapter."""
    seen: list[tuple] = []
    out = []
    for batch in batches:
        n = 0
        for prompt, adapter in batch:
            head = prompt[:-1]
            best = 0
            for old, a in seen:
                if a == adapter:
                    k = 0
                    while k < min(len(old), len(head)) and old[k] == head[k]:
                        k += 1
                    best = max(best, k)
            n += best
        seen += [(p[:-1], a) for p, a in batch]
        out.append(n)
    return out


def check_same(model, tok, batches, lora_rows: bool):
    cached = LocalEngine(model, tok, seed=0)
    plain = LocalEngine(model, tok, seed=0, prefix_cache=False)
    hits = expected_hits(batches)
    for k, batch in enumerate(batches):
        params = [SamplingParams(max_tokens=4, seed=100 * k + i, adapter=a if lora_rows else None)
                  for i, (_, a) in enumerate(batch)]
        prompts = [p for p, _ in batch]
        before = cached.stats["prefix_cache_tokens"]
        a, b = cached.generate_batch(prompts, params), plain.generate_batch(prompts, params)
        assert cached.stats["prefix_cache_tokens"] - before == hits[k]
        assert [g.response_ids for g in a] == [g.response_ids for g in b]
        for (prompt, adapter), x, y in zip(batch, a, b, strict=True):
            got = torch.tensor(x.response_logprobs)
            torch.testing.assert_close(got, torch.tensor(y.response_logprobs), atol=LOGPROB_ATOL, rtol=0)
            want = teacher_forced(model, prompt, x.response_ids, adapter if lora_rows else None)
            torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
    assert plain.stats["prefix_cache_tokens"] == 0 and len(plain._prefill.tree) == 0
    assert cached.stats["prompt_tokens"] == plain.stats["prompt_tokens"] == sum(
        len(p) for batch in batches for p, _ in batch)
    # (forwarded tokens include padding: a hit shortens its row, not always the batch's width)
    assert cached.stats["prefill_tokens"] <= plain.stats["prefill_tokens"]


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batches=prefix_sharing_batches([None]))
def test_cache_gives_the_tokens_and_logprobs_of_no_cache(model, tok, batches):
    check_same(model, tok, batches, lora_rows=False)


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batches=prefix_sharing_batches(["p1", "p2"]))
def test_rows_of_other_adapters_share_no_kv(two_policies, tok, batches):
    """Mixed-adapter batches (several policies): each adapter's prefixes are its own."""
    check_same(two_policies, tok, batches, lora_rows=True)


def test_a_group_prompt_is_prefilled_once_and_then_from_the_cache(model, tok):
    system = list(range(10, 40))
    groups = [system + [50 + q, 60, 61, 62, 63, 64, 65, 66, 67, 70 + q] for q in range(3)]
    eng = LocalEngine(model, tok, seed=0)
    params = SamplingParams(max_tokens=2, seed=1)
    eng.generate_batch([p for p in groups for _ in range(4)], params)  # 3 groups x 4
    # the system prompt once, then each group's question and last token once
    assert eng.stats["prefill_tokens"] == 30 + 3 * 10
    assert eng.stats["forward_calls"] == 2 + 1  # (+ one decode step)
    assert eng.stats["prefix_cache_tokens"] == 0
    eng.generate_batch([p for p in groups for _ in range(4)], params)  # the step's next batch
    assert eng.stats["prefill_tokens"] == 30 + 3 * 10 + 3  # each group's last token
    assert eng.stats["prefix_cache_tokens"] == 12 * (len(groups[0]) - 1)
    assert eng.stats["prompt_tokens"] == 2 * 12 * len(groups[0])


def test_new_weights_drop_every_prefix(model, tok):
    eng = LocalEngine(model, tok, seed=0)
    params = SamplingParams(max_tokens=2, seed=1)
    prompt = list(range(20, 45))
    eng.generate_batch([prompt], params)
    assert len(eng._prefill.tree) == len(prompt) - 1
    eng.generate_batch([prompt], params)
    assert eng.stats["prefix_cache_tokens"] == len(prompt) - 1
    eng.update_weights(None, 1)
    assert len(eng._prefill.tree) == 0 and eng._prefill.tree.nbytes == 0
    eng.generate_batch([prompt], params)
    assert eng.stats["prefix_cache_tokens"] == len(prompt) - 1  # computed again: no hit
    # a version the tree has not seen (weights changed without update_weights) drops it too
    eng.model_version = 2
    eng.generate_batch([prompt], params)
    assert eng.stats["prefix_cache_tokens"] == len(prompt) - 1
    assert {v for v, _ in eng._prefill.tree.roots} == {2}


def kv(n: int, value: float = 0.0):
    """One layer's KV of n tokens: 1 head of dim 2, fp32: 16 bytes a token (key and value)."""
    t = torch.full((1, 1, n, 2), value)
    return [(t, t.clone())]


def test_lru_leaves_go_first_shared_prefixes_last():
    tree = PrefixCache(budget=16 * 14)
    sys_ = [1, 2, 3, 4]
    paths = {}
    for name, q in (("a", [10, 11, 12]), ("b", [20, 21, 22]), ("c", [30, 31, 32])):
        path = tree.insert(0, None, sys_ + q)
        for nd in path:
            if nd.kv is None:
                tree.store(nd, kv(len(nd.ids), float(q[0])))
        paths[name] = path[-1]
    # the shared prefix was stored by "a" whole, then split where "b" left it
    assert tree.nbytes == 16 * (4 + 3 * 3) and len(tree) == 13
    assert tree.evict() == []  # within budget: nothing goes
    assert tree.match(0, None, sys_ + [10, 11, 12, 99]) == 7  # "a" used last now
    assert tree.match(0, None, sys_ + [99]) == 4
    assert tree.match(1, None, sys_) == 0 and tree.roots == {(1, None): tree.roots[(1, None)]}
    tree.clear()
    # again, then: a used after b and c; a budget of 2 questions and the system prompt
    for q in ([10, 11, 12], [20, 21, 22], [30, 31, 32]):
        for nd in tree.insert(0, None, sys_ + q):
            if nd.kv is None:
                tree.store(nd, kv(len(nd.ids)))
    tree.match(0, None, sys_ + [10, 11])
    tree.budget = 16 * (4 + 3 + 3)
    gone = tree.evict()
    assert [nd.ids for nd in gone] == [(20, 21, 22)]  # the least recently used leaf
    assert tree.match(0, None, sys_ + [30, 31, 32]) == 7 and tree.match(0, None, sys_ + [10, 11, 12]) == 7
    tree.budget = 16 * 4  # "c" was used before "a": it goes first; the system prompt is kept
    assert [nd.ids for nd in tree.evict()] == [(30, 31, 32), (10, 11, 12)]
    assert tree.match(0, None, sys_ + [10]) == 4 and tree.nbytes == 16 * 4
    tree.budget = 0  # a shared prefix goes once nothing below it is left
    assert [nd.ids for nd in tree.evict()] == [(1, 2, 3, 4)] and tree.nbytes == 0


def test_split_keeps_each_part_of_the_kv():
    tree = PrefixCache(budget=1 << 20)
    (node,) = tree.insert(0, "a", [5, 6, 7, 8, 9])
    k = torch.arange(10.0).reshape(1, 1, 5, 2)
    tree.store(node, [(k, -k)])
    path = tree.insert(0, "a", [5, 6, 7, 1])
    assert [nd.ids for nd in path] == [(5, 6, 7), (1,)]
    full = PrefixCache.path_kv(tree.insert(0, "a", [5, 6, 7, 8, 9])[-1])
    torch.testing.assert_close(full[0][0], k, rtol=0, atol=0)
    torch.testing.assert_close(full[0][1], -k, rtol=0, atol=0)
    assert tree.match(0, "a", [5, 6, 7, 8, 4]) == 4 and tree.match(0, "b", [5, 6]) == 0
    assert tree.nbytes == 2 * 5 * 2 * 4  # the split's halves: the same bytes as the whole


def test_engine_keeps_at_most_its_budget(model, tok):
    per_token = 2 * TINY["num_layers"] * TINY["num_kv_heads"] * (32 // 2) * 4  # K and V, fp32
    eng = LocalEngine(model, tok, seed=0, prefix_cache_bytes=30 * per_token)
    params = SamplingParams(max_tokens=2, seed=1)
    a, b = list(range(100, 121)), list(range(200, 221))  # 20-token heads: one fits, not two
    eng.generate_batch([a], params)
    assert eng._prefill.tree.nbytes == 20 * per_token
    eng.generate_batch([b], params)  # a, used before b, goes
    assert eng._prefill.tree.nbytes == 20 * per_token
    eng.generate_batch([b], params)
    assert eng.stats["prefix_cache_tokens"] == 20
    eng.generate_batch([a], params)
    assert eng.stats["prefix_cache_tokens"] == 20  # a was evicted: no hit
    off = LocalEngine(model, tok, seed=0, prefix_cache=False)
    off.generate_batch([a, a, b], params)
    assert off._prefill.tree.nbytes == 0 and len(off._prefill.tree) == 0
