"""The lm head's written-out gradient (learn/head.py) against autograd through the plain formula
z = (h W^T + b) / T, lp = z[y] - logsumexp(z), in fp32 and under bf16 autocast, any chunking.

Tolerances, from the arithmetic:
- the logprobs: the same ops, the matmul's rows summed in an order that may depend on the chunk:
  z within `hidden` fp32 roundings (one bf16 rounding under autocast) of its terms' magnitude,
  lp = z[y] - lse(z) within twice that.
- the gradients: the same dz = g (onehot - exp(z - lse)), moved only where z moved, and the same
  matmuls, whose sums may be split over the chunks in another order: in fp32 within K roundings
  (K the terms a sum adds) of the sum of its terms' magnitudes; under autocast one bf16 rounding
  of dz and the operands on each side, and dW's chunks added in fp32 here and in bf16 through
  autograd's cast of W (chunks + 2 bf16 roundings).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.learn import head as head_module
from tracetrain.learn.head import head_logprobs
from tracetrain.learn.logprobs import logprobs_from_logits


def plain(h, head, y, temperature):
    z = torch.nn.functional.linear(h, head.weight, head.bias).float()
    return logprobs_from_logits(z, y, temperature)[0]


def grads(fn, h0, head, y, g, precision):
    h = h0.clone().requires_grad_(True)
    for p in head.parameters():
        p.grad = None
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with ctx:
        lp = fn(h)
    (lp * g).sum().backward()
    return lp.detach(), h.grad, head.weight.grad, None if head.bias is None else head.bias.grad


@settings(max_examples=30, deadline=None)
@given(m=st.integers(0, 40), v=st.integers(2, 300), hidden=st.integers(1, 24),
       chunk=st.integers(1, 50), temperature=st.sampled_from([1.0, 0.7, 1.3]),
       bias=st.booleans(), precision=st.sampled_from(["fp32", "bf16"]), seed=st.integers(0, 99),
       keep=st.sampled_from([0, 256]))
def test_the_written_out_gradient_is_autograds(m, v, hidden, chunk, temperature, bias, precision, seed,
                                               keep):
    """... with the forward's logits kept for the backward or computed again (KEEP_LOGITS_MB)."""
    with budget(keep):
        check_against_autograd(m, v, hidden, chunk, temperature, bias, precision, seed)


@contextlib.contextmanager
def budget(mb: int):
    before, head_module.KEEP_LOGITS_MB = head_module.KEEP_LOGITS_MB, mb
    try:
        yield
    finally:
        head_module.KEEP_LOGITS_MB = before


def check_against_autograd(m, v, hidden, chunk, temperature, bias, precision, seed):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, v, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, hidden, generator=gen))
        if bias:
            head.bias.copy_(torch.randn(v, generator=gen))
    h0 = torch.randn(m, hidden, generator=gen)
    y = torch.randint(0, v, (m,), generator=gen)
    g = torch.randn(m, generator=gen)
    ours = grads(lambda h: head_logprobs(h, head, y, temperature=temperature, chunk=chunk),
                 h0, head, y, g, precision)
    ref = grads(lambda h: plain(h, head, y, temperature), h0, head, y, g, precision)
    assert ours[0].dtype == torch.float32 and ours[0].shape == (m,)
    if not m:
        return
    w, T = head.weight.detach(), temperature
    eps = 2.0**-24 if precision == "fp32" else 2.0**-8
    # z: the same ops, but a chunk's matmul may sum its `hidden` terms in another order than the
    # whole batch's (the kernel depends on the rows): within hidden fp32 roundings (one bf16
    # rounding) of the terms' magnitude Z; lp = z[y] - lse(z) within twice that
    Z = float((h0.abs() @ w.abs().T).max()) + (float(head.bias.detach().abs().max()) if bias else 0.0)
    dz = (hidden if precision == "fp32" else 1) * eps * Z / T
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=2 * dz)
    # dz = g (onehot - p) / T: |dz[m]| <= |g_m| / T in sum over v (<= 2 |g_m| / T), moved by at most
    # 2 |g_m| dz / T where z moved; each gradient a sum of such terms: K of them, K roundings each
    # (fp32), or in bf16 one rounding of dz and the operands plus autograd's bf16 sum of the chunks
    chunks = -(-m // chunk)
    rounds = {"dh": v if precision == "fp32" else 2, "dw": m if precision == "fp32" else chunks + 2}
    g_abs = g.abs()
    bounds = {"dh": 2 * float(g_abs.max()) * float(w.abs().max()) / T,
              "dw": 2 * float(g_abs @ h0.abs().max(1).values) / T, "db": 2 * float(g_abs.sum()) / T}
    for name, mine, theirs in (("dh", ours[1], ref[1]), ("dw", ours[2], ref[2]), ("db", ours[3], ref[3])):
        if theirs is None:
            assert mine is None or not mine.abs().sum()
            continue
        k = rounds.get(name, rounds["dw"])
        torch.testing.assert_close(mine, theirs, rtol=0, atol=(k * eps + 2 * dz) * bounds[name])


@pytest.mark.parametrize("keep_mb", [0, 1])
def test_the_logits_are_kept_only_within_their_budget(keep_mb, monkeypatch):
    """What the forward saves is h, y and lse, O(M H + M), and the [M, V] logits only where they
    fit in KEEP_LOGITS_MB (64 x 5,000 fp32: 1.2 MiB, over a budget of 1 or 0)."""
    monkeypatch.setattr(head_module, "KEEP_LOGITS_MB", keep_mb)
    head = torch.nn.Linear(8, 5000, bias=False)
    h = torch.randn(64, 8, requires_grad=True)
    y = torch.randint(0, 5000, (64,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        lp = head_logprobs(h, head, y, chunk=16)
    assert sum(saved) <= 64 * 8 + 5000 * 8 + 64 + 64 and max(saved) < 64 * 5000
    assert lp.grad_fn.kept is None  # (1.2 MiB > either budget)
    monkeypatch.setattr(head_module, "KEEP_LOGITS_MB", 2)
    lp = head_logprobs(h, head, y, chunk=16)
    assert sum(k.numel() for k in lp.grad_fn.kept) == 64 * 5000
    lp.sum().backward()
    assert lp.grad_fn.kept is None  # let go once used


@pytest.mark.parametrize("chunk", [1, 7, 512])
def test_rows_of_no_gradient_and_an_empty_batch(chunk):
    head = torch.nn.Linear(4, 11)
    h = torch.randn(5, 4, requires_grad=True)
    y = torch.randint(0, 11, (5,))
    lp = head_logprobs(h, head, y, chunk=chunk)
    (lp * torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])).sum().backward()
    assert h.grad[[0, 2, 3, 4]].abs().sum() == 0 and h.grad[1].abs().sum() > 0
    empty = head_logprobs(torch.zeros(0, 4), head, torch.zeros(0, dtype=torch.int64), chunk=chunk)
    assert empty.shape == (0,) and empty.dtype == torch.float32
