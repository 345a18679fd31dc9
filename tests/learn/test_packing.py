"""Packed rows, shared prefixes computed once and chunked logprobs give the plain padded
computation's logprobs, loss and gradients (docs/invariants.md invariant 10), and invariants 1-3 hold on
that path.

Tolerance: both sides compute the same per-token terms in fp32 through matmuls of other shapes
(one packed sequence vs a padded rectangle) and add a shared prefix's gradient contributions in
another order. Each gradient entry is a sum of at most a few hundred products here, so the
reassociation error is <~ 300 u = 2e-5 of the sum of the magnitudes summed (u = 6e-8); comparing
against 1e-4 of the tensor's largest entry, plus 1e-6 absolute for entries that cancel to ~0,
leaves room without hiding a wrong token (that moves entries by O(1) of the scale).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tiny_model import VOCAB, logprobs_and_entropy, tiny_causal_lm

from tracetrain.config import build_config
from tracetrain.learn.packing import pack_rows, row_costs, row_logprobs
from tracetrain.learn.update import ppo_update
from tracetrain.objective.weights import MODES
from tracetrain.rows.batch import TrainingBatch


def shared_batch(seed: int, groups: list[list[int]], *, common: int, question: int) -> TrainingBatch:
    """Rows that share prefixes the way a step's do: every row starts with `common` tokens (the
    system prompt), a group's rows then with the group's `question` tokens, and row j of a
    rollout with the rollout's turns before it (transition rows: turn j's row holds turns < j as
    its prompt). groups[g] = rows per rollout of group g."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    system = rand(common)
    prompts, responses, rollout_index, group_ids = [], [], [], []
    k = 0
    for gi, rollouts in enumerate(groups):
        q = system + rand(question)
        for n_rows in rollouts:
            context = q + rand(int(torch.randint(1, 3, (1,), generator=g)))
            for _ in range(n_rows):
                resp = rand(int(torch.randint(1, 5, (1,), generator=g)))
                prompts.append(list(context))
                responses.append(resp)
                rollout_index.append(k)
                group_ids.append(f"g{gi}")
                context = context + resp + rand(int(torch.randint(1, 3, (1,), generator=g)))
            k += 1
    P, R = max(map(len, prompts)), max(map(len, responses))
    n = len(prompts)
    ids = torch.zeros(n, P + R, dtype=torch.int64)
    att = torch.zeros_like(ids)
    mask = torch.zeros(n, R, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, P - len(p) : P + len(r)] = torch.tensor(p + r)
        att[i, P - len(p) : P + len(r)] = 1
        mask[i, : len(r)] = torch.rand(len(r), generator=g) < 0.8
        mask[i, 0] = True
    ri = torch.tensor(rollout_index)
    names = [f"r{j}" for j in range(k)]
    old = (logprobs_and_entropy(tiny_causal_lm(0), {"input_ids": ids, "attention_mask": att,
           "position_ids": (att.cumsum(1) - 1).clamp(min=0), "response_mask": mask})[0].detach()
           + 0.2 * torch.randn(n, R, generator=g)) * mask
    return TrainingBatch(
        input_ids=ids, attention_mask=att, position_ids=(att.cumsum(1) - 1).clamp(min=0),
        response_mask=mask, rollout_logprobs=old, rollout_ids=[names[j] for j in rollout_index],
        group_ids=group_ids, turn_index=torch.zeros(n, dtype=torch.int64), rollout_index=ri,
        rollouts=names, rewards=torch.rand(k, generator=g),
    )


def update_gradients(batch, adv, *, mode="rollout-mean", mini_batches=1, kl=True, entropy=True,
                     attn="eager", **optim):
    """ppo_update's loss and parameter gradients (lr 0: the gradient is left in .grad, one
    mini-batch) with the reference model's KL and the entropy term on."""
    model = tiny_causal_lm(0)
    model.set_attn_implementation(attn)
    ref = tiny_causal_lm(1) if kl else None
    cfg = build_config({
        "optim": {"lr": 1e-3, "warmup_steps": 0, "grad_clip": 1e9, "mini_batches": mini_batches,
                  **optim},
        "loss": {"mode": mode, "kl_coef": 0.05 if kl else 0.0, "entropy_coef": 0.01 if entropy else 0.0,
                 **({"norm_length": 7.0} if mode == "seq-mean-token-sum-norm" else {})},
    })
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    (res,) = ppo_update(model, opt, batch, adv, cfg, ref_model=ref)
    return res, [p.grad.detach().clone() for p in model.parameters()]


def assert_close_grads(got, expected):
    for a, e in zip(got, expected, strict=True):
        tol = 1e-4 * float(e.abs().max()) + 1e-6
        assert float((a - e).abs().max()) <= tol, (float((a - e).abs().max()), tol)


PLAIN = {"pack_rows": False, "logprob_chunk": 0}


@settings(max_examples=25)
@given(
    seed=st.integers(0, 10_000),
    groups=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=3),
    common=st.integers(0, 6),
    question=st.integers(0, 3),
    mode=st.sampled_from(sorted(MODES)),
    share=st.booleans(),
    chunk=st.sampled_from([0, 1, 3, 512]),
    pack_tokens=st.sampled_from([8, 20, 64, 10_000]),
    attn=st.sampled_from(["eager", "sdpa"]),
)
def test_packed_shared_chunked_equal_plain(seed, groups, common, question, mode, share, chunk,
                                           pack_tokens, attn):
    batch = shared_batch(seed, groups, common=common, question=question)
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(seed))
    plain, g_plain = update_gradients(batch, adv, mode=mode, attn=attn, **PLAIN)
    fast, g_fast = update_gradients(batch, adv, mode=mode, attn=attn, pack_rows=True,
                                    share_prefixes=share, logprob_chunk=chunk, pack_tokens=pack_tokens)
    assert fast.loss == pytest.approx(plain.loss, rel=1e-5, abs=1e-6)
    assert fast.metrics["weight_mass"] == pytest.approx(plain.metrics["weight_mass"], abs=1e-6)
    for k in ("entropy", "kl", "clip_frac"):
        if k in plain.metrics:
            assert fast.metrics[k] == pytest.approx(plain.metrics[k], rel=1e-4, abs=1e-6)
    assert_close_grads(g_fast, g_plain)
    # what sharing saves: fewer computed tokens than real ones when rows share a start
    real = int(batch.attention_mask.sum())
    assert plain.metrics["tokens_computed"] == plain.metrics["tokens_padded"]
    if share and pack_tokens == 10_000 and batch.n_rows > 1 and common > 0:
        assert fast.metrics["tokens_computed"] <= real - common
    elif not share:
        assert fast.metrics["tokens_computed"] == real


@settings(max_examples=15)
@given(seed=st.integers(0, 10_000), rows=st.integers(2, 6), share=st.booleans(),
       attn=st.sampled_from(["eager", "sdpa"]))
def test_changing_one_rows_token_leaves_other_rows_logprobs(seed, rows, share, attn):
    batch = shared_batch(seed, [[1] * rows], common=4, question=2)
    model = tiny_causal_lm(0)
    model.set_attn_implementation(attn)
    need = batch.response_mask
    args = (batch.attention_mask, batch.position_ids, batch.response_length, need)
    with torch.no_grad():
        before, _, _ = row_logprobs(model, batch.input_ids, *args, share=share)
        i = seed % rows
        real = batch.attention_mask[i].nonzero().squeeze(1)
        col = int(real[len(real) // 2])  # a token in the middle of row i (in the shared part too)
        ids = batch.input_ids.clone()
        ids[i, col] = ids[i, col] % (VOCAB - 1) + 1
        after, _, _ = row_logprobs(model, ids, *args, share=share)
    others = torch.arange(rows) != i
    torch.testing.assert_close(after[others], before[others], rtol=1e-5, atol=1e-6)
    # and row i itself did see the change (a trained token after the changed one moved)
    P = batch.prompt_length
    later = need[i] & (torch.arange(batch.response_length) + P > col)
    assume(bool(later.any()))
    assert not torch.allclose(after[i][later], before[i][later])


def test_pack_shares_exactly_the_common_starts():
    # rows: [a b c x], [a b c y z], [a b d]: nodes a b c x y z d = 7 of 12 real tokens
    ids = torch.tensor([[0, 1, 2, 3, 10, 0], [1, 2, 3, 11, 12, 0], [0, 0, 1, 2, 4, 0]])
    att = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0]])
    pk = pack_rows(ids, att)
    assert pk.input_ids.tolist() == [[1, 2, 3, 10, 11, 12, 4]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 2]]
    assert pk.node.tolist() == [[-1, 0, 1, 2, 3, -1], [0, 1, 2, 4, 5, -1], [-1, -1, 0, 1, 6, -1]]
    # node 5 (z) sees a b c y z; node 6 (d) sees a b d; node 3 (x) never sees y or z
    assert pk.allowed[5].nonzero().squeeze(1).tolist() == [0, 1, 2, 4, 5]
    assert pk.allowed[6].nonzero().squeeze(1).tolist() == [0, 1, 6]
    assert pk.allowed[3].nonzero().squeeze(1).tolist() == [0, 1, 2, 3]
    assert pk.n_row_tokens == 12
    # planning bound: row costs against the previous row, 4 + 2 + 1 >= N = 7
    assert row_costs(ids, att).tolist() == [4, 2, 1]
    unshared = pack_rows(ids, att, share=False)
    assert unshared.n_tokens == 12 and unshared.position_ids.tolist()[0][:4] == [0, 1, 2, 3]


def merged(batch: TrainingBatch) -> TrainingBatch:
    """Each rollout's transition rows as one trajectory row holding the same trained tokens in
    the same contexts: the first row's prompt, then the last row's tokens after it, the mask and
    old logprobs of each turn's response at its place."""
    P = batch.prompt_length
    seqs, masks, olds, first = [], [], [], {}
    for r in range(batch.n_rollouts):
        rows = (batch.rollout_index == r).nonzero().squeeze(1).tolist()
        real = [batch.input_ids[i][batch.attention_mask[i].bool()].tolist() for i in rows]
        plen = [int(batch.attention_mask[i, :P].sum()) for i in rows]
        full = real[-1]
        m = [False] * (len(full) - plen[0])
        o = [0.0] * len(m)
        for i, pl in zip(rows, plen, strict=True):
            for t in range(batch.response_length):
                if batch.response_mask[i, t]:
                    m[pl + t - plen[0]] = True
                    o[pl + t - plen[0]] = float(batch.rollout_logprobs[i, t])
        seqs.append((full[: plen[0]], full[plen[0]:]))
        masks.append(m)
        olds.append(o)
        first[r] = rows[0]
    P2, R2 = max(len(p) for p, _ in seqs), max(len(r) for _, r in seqs)
    n = len(seqs)
    ids = torch.zeros(n, P2 + R2, dtype=torch.int64)
    att = torch.zeros_like(ids)
    mask = torch.zeros(n, R2, dtype=torch.bool)
    old = torch.zeros(n, R2)
    for i, ((p, r), m, o) in enumerate(zip(seqs, masks, olds, strict=True)):
        ids[i, P2 - len(p) : P2 + len(r)] = torch.tensor(p + r)
        att[i, P2 - len(p) : P2 + len(r)] = 1
        mask[i, : len(r)] = torch.tensor(m)
        old[i, : len(r)] = torch.tensor(o)
    return TrainingBatch(
        input_ids=ids, attention_mask=att, position_ids=(att.cumsum(1) - 1).clamp(min=0),
        response_mask=mask, rollout_logprobs=old, rollout_ids=list(batch.rollouts),
        group_ids=[batch.group_ids[first[r]] for r in range(n)],
        turn_index=torch.zeros(n, dtype=torch.int64), rollout_index=torch.arange(n),
        rollouts=list(batch.rollouts), rewards=batch.rewards,
    )


def test_split_mass_and_partition_invariance_on_the_packed_path():
    """Invariants 1-3 on the packed path (shared prefixes, chunks): a rollout's rows merged into
    one row holding the same trained tokens, or the step cut into packs of other sizes, leave the
    loss and gradient of rollout-mean unchanged, and the weights sum to 1, 1/R per rollout."""
    batch = shared_batch(3, [[3, 2], [1, 2]], common=5, question=2)
    assert batch.n_rows > batch.n_rollouts
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(0))
    expected, g_expected = update_gradients(batch, adv, **PLAIN)
    one_row = merged(batch)
    assert int(one_row.response_mask.sum()) == int(batch.response_mask.sum())
    for b in (batch, one_row):
        for pack_tokens in (6, 25, 10_000):
            res, g = update_gradients(b, adv, pack_tokens=pack_tokens, logprob_chunk=4)
            assert res.metrics["weight_mass"] == pytest.approx(1.0, abs=1e-6)
            assert res.metrics["rollout_mass_min"] == pytest.approx(1 / batch.n_rollouts)
            assert res.metrics["rollout_mass_max"] == pytest.approx(1 / batch.n_rollouts)
            assert res.loss == pytest.approx(expected.loss, rel=1e-5, abs=1e-6)
            assert_close_grads(g, g_expected)


def test_mini_batches_do_not_depend_on_packing():
    """Mini-batches are balanced by the rows' real tokens whatever the forward computes, so a run
    with packing on updates on the same rollouts, in the same order, as one without."""
    batch = shared_batch(5, [[2, 1, 3], [1, 1], [2, 2]], common=6, question=3)
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(1))
    cfgs = [PLAIN, {"pack_rows": True, "share_prefixes": True, "pack_tokens": 16}]
    runs = []
    for optim in cfgs:
        model = tiny_causal_lm(0)
        cfg = build_config({"optim": {"lr": 1e-2, "warmup_steps": 0, "mini_batches": 3, **optim}})
        runs.append(ppo_update(model, torch.optim.SGD(model.parameters(), lr=1e-2), batch, adv, cfg))
    plain, packed = runs
    assert [r.metrics["n_rollouts"] for r in packed] == [r.metrics["n_rollouts"] for r in plain]
    assert [r.loss for r in packed] == pytest.approx([r.loss for r in plain], rel=1e-5, abs=1e-6)
    assert (sum(r.metrics["tokens_computed"] for r in packed)
            < sum(r.metrics["tokens_computed"] for r in plain))
    # rollout-mean: each rollout weighs 1/R of its update, however many rollouts each update has;
    # the step line averages the product per update (a mean of 1/R times a mean of R is not 1)
    from tracetrain.run.rundir import format_step

    counts = {r.metrics["n_rollouts"] for r in packed}
    assert len(counts) > 1  # updates of unequal size: the case the product per update is for
    for r in packed:
        assert r.metrics["rollout_mass_x_R_min"] == pytest.approx(1.0)
        assert r.metrics["rollout_mass_x_R_max"] == pytest.approx(1.0)
    step = {"step": 0, "reward_mean": 0.5, "rollouts_per_s": 1.0, "trained_tokens_per_s": 1.0,
            "rows_per_rollout": 1.0, "n_failed": 0, "n_timed_out": 0,
            **{f"loss/{k}": sum(r.metrics[k] for r in packed) / len(packed) for k in packed[0].metrics}}
    assert "mass/rollout x R 1.000..1.000" in format_step(step)
