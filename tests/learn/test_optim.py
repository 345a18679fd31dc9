"""adamw: the fused kernel where there is one, the same update as torch's plain AdamW."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.learn import optim


@settings(max_examples=20, deadline=None)
@given(lr=st.floats(1e-5, 1e-1), weight_decay=st.floats(0.0, 0.5), seed=st.integers(0, 1000))
def test_fused_is_the_plain_adamw_update(lr, weight_decay, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 2, 4)]
    a = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fused = optim.adamw(a, lr=lr, weight_decay=weight_decay)
    plain = torch.optim.AdamW(b, lr=lr, weight_decay=weight_decay)
    assert fused.defaults["fused"] is True  # the kernel really is used on CPU
    for _ in range(4):
        for p, q in zip(a, b, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert not torch.equal(p, torch.zeros_like(p))


def test_unfused_where_the_kernel_is_refused(monkeypatch):
    made = []

    class NoFused(torch.optim.AdamW):
        def __init__(self, params, fused=None, **kw):
            if fused:
                raise RuntimeError("`fused=True` requires ... supported devices")
            made.append(kw)
            super().__init__(params, **kw)

    monkeypatch.setattr(optim.torch.optim, "AdamW", NoFused)
    opt = optim.adamw([torch.nn.Parameter(torch.ones(2))], lr=0.5, weight_decay=0.0)
    assert isinstance(opt, NoFused) and made == [{"lr": 0.5, "weight_decay": 0.0}]
    assert not opt.defaults["fused"]
