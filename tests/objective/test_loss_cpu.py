"""loss_cpu's speed-ups against the plain versions in loss.py: equal row counts; allclose losses,
sums and gradients over random shapes, masks, rollout cuts, block sizes and options."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.objective import loss, loss_cpu, weights
from tracetrain.objective.loss import KL_ESTIMATORS, policy_loss
from tracetrain.objective.weights import MODES, NORM_MODES, RowWeights, row_scales

# --- row token counts: the int64 byte-lane sum equals mask.sum(1) ------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(0, 2100), st.integers(0, 9), st.floats(0, 1))
def test_row_token_counts_equals_mask_sum(rows, width, offset, p):
    g = torch.Generator().manual_seed(rows * 10007 + width * 13 + offset)
    mask = (torch.rand(rows, width + offset, generator=g) < p)[:, offset:]  # any byte alignment
    assert torch.equal(loss_cpu.row_token_counts(mask), mask.sum(1))


def test_row_token_counts_of_many_rows_with_a_tail():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(700, 2048 + 13, generator=g) < 0.5  # 2 blocks of 128 words, 1 word, 5 bytes
    assert torch.equal(loss_cpu.row_token_counts(mask), mask.sum(1))


def test_row_token_counts_all_ones_does_not_carry():
    mask = torch.ones(3, 2048 + 8 * 255 + 5, dtype=torch.bool)  # full 128-word blocks and a tail
    assert loss_cpu.row_token_counts(mask).tolist() == [mask.shape[1]] * 3
    assert loss_cpu.row_token_counts(mask[:, 1:]).tolist() == [mask.shape[1] - 1] * 3


def test_loss_row_token_counts_picks_the_fast_one_on_cpu_above_the_size(monkeypatch):
    calls = []
    fast = loss_cpu.row_token_counts
    monkeypatch.setattr(loss_cpu, "row_token_counts", lambda m: calls.append(m) or fast(m))
    small = torch.ones(2, 3, dtype=torch.bool)
    big = torch.ones(4, loss_cpu.COUNTS_MIN, dtype=torch.bool)
    assert weights.row_token_counts(small).tolist() == [3, 3] and not calls
    assert weights.row_token_counts(big).tolist() == [loss_cpu.COUNTS_MIN] * 4 and len(calls) == 1


# --- KL estimators: value and derivative against autograd on the plain ones --------------------


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_value_and_derivative_match_autograd_on_the_plain_estimator(name):
    assert set(loss_cpu.KL_GRADS) == set(KL_ESTIMATORS)
    g = torch.Generator().manual_seed(0)
    lp = -3 * torch.rand(4, 257, generator=g)
    ref = lp + torch.linspace(-25, 25, 4 * 257).view(4, 257)  # past both clamps of k3
    x = lp.clone().requires_grad_()
    plain = KL_ESTIMATORS[name](x, ref)
    (grad,) = torch.autograd.grad(plain.sum(), x)
    out, t1, t2 = torch.empty_like(lp), torch.empty_like(lp), torch.empty_like(lp)
    d = loss_cpu.KL_GRADS[name](lp, ref, 0.3, out, t1, t2)
    torch.testing.assert_close(out, plain.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.as_tensor(d).expand_as(lp), 0.3 * grad, rtol=1e-5, atol=1e-6)


# --- the policy loss: blocked (loss_cpu) against plain autograd (loss) -------------------------


@st.composite
def loss_cases(draw):
    rows = draw(st.integers(1, 9))
    width = draw(st.integers(1, 40))
    n_rollouts = draw(st.integers(1, 4))
    case = {
        "rows": rows,
        "width": width,
        "seed": draw(st.integers(0, 2**31 - 1)),
        "rollout_of_row": draw(st.lists(st.integers(0, n_rollouts - 1), min_size=rows, max_size=rows)),
        "p": draw(st.sampled_from([0.0, 0.3, 0.8, 1.0])),
        "mode": draw(st.sampled_from(sorted(MODES))),
        "full_weights": draw(st.booleans()),
        "adv_per_row": draw(st.booleans()),
        "spread": draw(st.sampled_from([0.05, 0.5, 3.0])),  # of logprob - old: how much is clipped
        "is_weights": draw(st.booleans()),
        "kl": draw(st.sampled_from([None, *sorted(KL_ESTIMATORS)])),
        "kl_coef": draw(st.sampled_from([0.0, 0.3])),
        "entropy": draw(st.booleans()),
        "entropy_coef": draw(st.sampled_from([0.0, 0.05])),
        "clip": draw(st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.0, 0.0)])),
        "dual_clip": draw(st.sampled_from([None, 3.0, 1.5])),
        "chunk_tokens": draw(st.integers(1, 3 * width + 1)),  # blocks of 1 to 3 rows, a short last
    }
    if case["kl"] is None:
        case["kl_coef"] = 0.0
    if not case["entropy"]:
        case["entropy_coef"] = 0.0
    return case


def make(case):
    rows, width = case["rows"], case["width"]
    g = torch.Generator().manual_seed(case["seed"])
    mask = torch.rand(rows, width, generator=g) < case["p"]
    ids = torch.tensor(case["rollout_of_row"])
    mode = case["mode"]
    scales = row_scales(mask, ids, mode=mode, norm_length=8 if mode in NORM_MODES else None)
    weights = (mask, scales)
    if case["full_weights"]:
        weights = mask * scales[:, None] + torch.rand(rows, width, generator=g) * (torch.rand(()) < 0.5)
    lp = torch.randn(rows, width, generator=g) * 0.5 - 1
    old = lp + case["spread"] * torch.randn(rows, width, generator=g)
    adv = torch.randn(rows if case["adv_per_row"] else (rows, width), generator=g)
    adv[torch.rand(adv.shape, generator=g) < 0.2] = 0.0
    return {
        "logprobs": lp,
        "old_logprobs": old,
        "advantages": adv,
        "weights": weights,
        "is_weights": torch.rand(rows, width, generator=g) * 2 if case["is_weights"] else None,
        "ref_logprobs": lp + 1.5 * torch.randn(rows, width, generator=g) if case["kl"] else None,
        "entropy": torch.rand(rows, width, generator=g) * 3 if case["entropy"] else None,
    }


def run(fn, x, case, **extra):
    """(loss, sums, d loss / d logprobs, d loss / d entropy or None) of one implementation."""
    lp = x["logprobs"].clone().requires_grad_()
    ent = None if x["entropy"] is None else x["entropy"].clone().requires_grad_()
    loss_value, sums = fn(
        lp,
        x["old_logprobs"],
        x["advantages"],
        x["weights"],
        clip_low=case["clip"][0],
        clip_high=case["clip"][1],
        dual_clip=case["dual_clip"],
        is_weights=x["is_weights"],
        ref_logprobs=x["ref_logprobs"],
        kl_estimator=case["kl"] or "k3",
        kl_coef=case["kl_coef"],
        entropy=ent,
        entropy_coef=case["entropy_coef"],
        **extra,
    )
    loss_value.backward()
    return loss_value.detach(), sums, lp.grad, None if ent is None else ent.grad


def assert_same(plain, fast, *, metrics=True):
    """Tolerances from the arithmetic (u = 2^-24 ~ 6e-8): per token both paths apply the same
    fp32 formulas, fused differently (addcmul, clamps as per-row bounds), a few u apart; each sum
    is a cascade sum (a few u of sum |w x| at any length, blocks in fp64). rtol 1e-5 (~170 u)
    covers both with room; atol covers sums whose terms cancel (|error| <~ 10 u sum |w x|, and
    sum |w x| <= mass * max |x| ~ 10 here). Neither grows with the rows' size or the CPU."""
    (l0, s0, g0, e0), (l1, s1, g1, e1) = plain, fast
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)
    assert (e0 is None) == (e1 is None)  # no entropy gradient when entropy_coef == 0
    if e0 is not None:
        torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-7)
    assert set(s0) == set(s1) == set(loss.SUMS)
    for k in loss.SUMS if metrics else ("pg", "mass", "kl_ref", "entropy"):
        torch.testing.assert_close(s1[k], s0[k], rtol=1e-5, atol=2e-6, msg=k)


@settings(max_examples=300, deadline=None)
@given(loss_cases())
def test_blocked_policy_loss_equals_the_plain_one(case):
    x = make(case)
    plain = run(loss.policy_loss_sums, x, case)
    fast = run(loss_cpu.policy_loss_sums, x, case, chunk_tokens=case["chunk_tokens"])
    assert_same(plain, fast)


@settings(max_examples=60, deadline=None)
@given(loss_cases())
def test_blocked_policy_loss_equals_the_plain_one_past_the_ratio_clamp(case):
    """|logprob - old| up to 30, past the clamp at 20: the gradient is cut there in both; only the
    clip_frac metric may count such a token differently (see loss_cpu.policy_loss_sums)."""
    x = make(case)
    x["old_logprobs"] = x["logprobs"] + 30 * (2 * torch.rand(x["logprobs"].shape) - 1)
    plain = run(loss.policy_loss_sums, x, case)
    fast = run(loss_cpu.policy_loss_sums, x, case, chunk_tokens=case["chunk_tokens"])
    assert_same(plain, fast, metrics=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_blocked_policy_loss_keeps_the_input_dtypes_and_scales_by_the_incoming_gradient(dtype):
    case = {"clip": (0.2, 0.2), "dual_clip": 3.0, "kl": "k3", "kl_coef": 0.1, "entropy_coef": 0.02}
    x = make({**case, "rows": 5, "width": 7, "seed": 3, "rollout_of_row": [0, 0, 1, 2, 2],
              "p": 0.8, "mode": "rollout-mean", "full_weights": False, "adv_per_row": True,
              "spread": 0.5, "is_weights": False, "entropy": True})
    x = {k: v.to(dtype) if isinstance(v, torch.Tensor) and k != "advantages" else v
         for k, v in x.items()}
    results = []
    for fn, extra in ((loss.policy_loss_sums, {}), (loss_cpu.policy_loss_sums, {"chunk_tokens": 14})):
        lp = x["logprobs"].clone().requires_grad_()
        ent = x["entropy"].clone().requires_grad_()
        value, _ = fn(lp, x["old_logprobs"], x["advantages"], x["weights"], clip_low=0.2,
                      clip_high=0.2, dual_clip=3.0, is_weights=None,
                      ref_logprobs=x["ref_logprobs"], kl_estimator="k3", kl_coef=0.1,
                      entropy=ent, entropy_coef=0.02, **extra)
        (-2.5 * value).backward()  # an incoming gradient other than 1
        assert value.dtype == torch.float32
        assert lp.grad.dtype == dtype and ent.grad.dtype == dtype
        results.append((value, lp.grad.double(), ent.grad.double()))
    (v0, g0, e0), (v1, g1, e1) = results
    torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-6)
    tol = {"rtol": 1e-2, "atol": 1e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(g1, g0, **tol)
    torch.testing.assert_close(e1, e0, **tol)


def test_policy_loss_picks_the_blocked_path_on_cpu_from_loss_min_tokens(monkeypatch):
    calls = []
    fast = loss_cpu.policy_loss_sums
    monkeypatch.setattr(loss_cpu, "policy_loss_sums", lambda *a, **k: calls.append(1) or fast(*a, **k))
    g = torch.Generator().manual_seed(0)
    loss_min = loss_cpu.LOSS_MIN
    for rows, want in ((3, 0), (loss_min // 64, 1)):
        mask = torch.rand(rows, 64, generator=g) < 0.7
        ids = torch.arange(rows) // 2
        lp = -torch.rand(rows, 64, generator=g)
        args = (lp, lp + 0.2 * torch.randn(rows, 64, generator=g), torch.randn(rows, generator=g))
        weights = RowWeights(mask, row_scales(mask, ids))
        calls.clear()
        _, metrics = policy_loss(*args, weights)
        assert len(calls) == want
        monkeypatch.setattr(loss_cpu, "LOSS_MIN", 10**12)  # the same call on the plain path
        _, plain = policy_loss(*args, weights)
        monkeypatch.setattr(loss_cpu, "LOSS_MIN", loss_min)
        assert metrics.keys() == plain.keys()
        for k in metrics:
            torch.testing.assert_close(metrics[k], plain[k], rtol=1e-5, atol=1e-6, msg=k)


BENCH_CASE = {"clip": (0.2, 0.28), "dual_clip": 3.0, "kl": "k3", "kl_coef": 0.01, "entropy_coef": 0.01}


def bench_sized(adv_per_row: bool, isw: bool) -> dict:
    """133 rows of 2048 tokens, ~245k trained (several default blocks, the last one short)."""
    rows = 2 * loss_cpu.BLOCK // 2048 + 5
    return make({**BENCH_CASE, "rows": rows, "width": 2048, "seed": 5, "p": 0.9,
                 "mode": "rollout-mean", "rollout_of_row": [i // 3 for i in range(rows)],
                 "full_weights": False, "adv_per_row": adv_per_row, "spread": 0.3,
                 "is_weights": isw, "entropy": True})


# The bound the mass checks rely on: w[i,t] = m[i,t] s_i with s_i = 1 / (R T_r) rounded once
# (relative error <= u = 2^-24 ~ 6e-8, the same sign for all tokens of a rollout), so the exact sum
# of the fp32 weights is 1 within u; each path then sums them with torch's cascade sum (error a few
# u at any length: 0.7-1.5e-7 measured from 2^12 to 2^24 terms), blocks added in fp64. 1e-6 is
# ~16 u: it does not depend on the token count, and a sequential fp32 accumulation over 245k
# tokens (MKL's matrix-vector product on its generic path: 2.4e-5 off) fails it.
MASS_TOL = 1e-6


def test_blocked_policy_loss_equals_the_plain_one_on_bench_sized_rows():
    """Per-token advantages with IS weights, and per-row advantages: as the trainer and
    bench/bench_loss.py use it. Both masses are 1 within MASS_TOL."""
    for adv_per_row, isw in ((True, False), (False, True)):
        x = bench_sized(adv_per_row, isw)
        plain = run(loss.policy_loss_sums, x, BENCH_CASE)
        fast = run(loss_cpu.policy_loss_sums, x, BENCH_CASE, chunk_tokens=loss_cpu.BLOCK)
        assert_same(plain, fast)
        for sums in (plain[1], fast[1]):
            assert abs(float(sums["mass"]) - 1.0) <= MASS_TOL, float(sums["mass"])


_MASS_SCRIPT = """
import json, torch, test_loss_cpu as t
from tracetrain.objective import loss
from tracetrain.objective import loss_cpu
x = t.bench_sized(True, False)
out = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
for name, fn in (("plain", loss.policy_loss_sums), ("fast", loss_cpu.policy_loss_sums)):
    value, sums = fn(x["logprobs"], x["old_logprobs"], x["advantages"], x["weights"], clip_low=0.2,
                     clip_high=0.28, dual_clip=3.0, is_weights=None, ref_logprobs=x["ref_logprobs"],
                     kl_estimator="k3", kl_coef=0.01, entropy=x["entropy"], entropy_coef=0.01)
    out[name] = {"loss": float(value), **{k: float(v) for k, v in sums.items()}}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("capability,threads,mkl_cbwr", [
    ("default", 1, "COMPATIBLE"), ("avx2", 2, "COMPATIBLE"), ("avx512", 2, "COMPATIBLE"),
    ("avx512", 1, None),
])
def test_blocked_policy_loss_mass_is_one_under_each_cpu_kernel(capability, threads, mkl_cbwr):
    """The bench-sized mass under each of torch's CPU kernels, with 1 and 2 threads, and with MKL
    on its generic code path (MKL_CBWR=COMPATIBLE: the path an AMD CPU gets, whatever CPU runs
    this): 1 within MASS_TOL on both paths, and the two paths' sums agree."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(threads)}
    env.pop("MKL_CBWR", None)
    if mkl_cbwr:
        env["MKL_CBWR"] = mkl_cbwr
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", _MASS_SCRIPT], cwd=here, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["threads"] == threads
    for name in ("plain", "fast"):
        assert abs(out[name]["mass"] - 1.0) <= MASS_TOL, (name, out)
    for k in ("loss", "pg", "kl_ref", "entropy", "approx_kl", "clip"):
        assert out["fast"][k] == pytest.approx(out["plain"][k], rel=1e-5, abs=2e-6), (k, out)
