"""tracetrain's loss inside verl 0.9.1 (real verl, CPU).

- The registered policy losses are what verl's get_policy_loss_fn returns, and equal tracetrain's
  policy_loss times dp_size (and verl's own vanilla surrogate under its "token-sum" aggregation).
- The key property: the gradient verl's real actor computes (TrainingWorker.train_mini_batch ->
  FSDP2 engine -> verl's micro-batches -> verl's ppo_loss -> our registered loss -> backward ->
  optimizer step), for random rollouts cut into random rows, equals tracetrain's single-process
  gradient of each mini-batch, whatever verl's micro-batch size; also with KL and entropy (our full
  loss function), and on 2 real data-parallel ranks (gloo).

verl runs on CPU through its platform plugin interface (tests/support/verl_cpu.py). The optimizer's lr is
1e-12 so that the parameters stay put between mini-batches: each mini-batch's gradient is captured
just before verl's optimizer step and compared with tracetrain's at the same parameters.
"""

from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tiny_model import logprobs_and_entropy, tiny_causal_lm
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_policy_loss_fn
from verl.workers.config import FSDPActorConfig
from verl_cpu import LocalActorGroup, training_batch

from tracetrain.integrations.verl import loss as verl_loss
from tracetrain.integrations.verl.dataproto import to_dataproto
from tracetrain.integrations.verl.trainer import update_actor
from tracetrain.objective.loss import policy_loss
from tracetrain.objective.minibatch import plan_step
from tracetrain.objective.weights import MODES, RowWeights, token_weights

MODE_NAMES = sorted(MODES)
KL_COEF, ENTROPY_COEF = 0.05, 0.01


def norm(mode: str) -> float | None:
    return 7.0 if mode == "seq-mean-token-sum-norm" else None


def actor_config(**kw) -> FSDPActorConfig:
    base = dict(
        strategy="fsdp2",
        rollout_n=1,
        use_dynamic_bsz=True,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    return FSDPActorConfig(**{**base, **kw})


# --------------------------------------------------------------------------- the registered loss
def test_get_policy_loss_fn_finds_every_mode():
    for name in ["rollout-mean", *MODE_NAMES]:
        assert get_policy_loss_fn(name) is verl_loss.weighted_policy_loss
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla  # verl's own still there
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        get_policy_loss_fn("rollout-sum")


@settings(max_examples=20, deadline=None)
@given(
    rows_per_rollout=st.lists(st.integers(1, 3), min_size=1, max_size=6),
    seed=st.integers(0, 10_000),
    dp_size=st.sampled_from([1, 2, 4]),
    mode=st.sampled_from(MODE_NAMES),
    cut=st.integers(1, 17),
)
def test_registered_loss_is_tracetrains_times_dp_size(rows_per_rollout, seed, dp_size, mode, cut):
    batch, _, adv, _ = training_batch(rows_per_rollout, seed=seed)
    mask, old = batch.response_mask, batch.rollout_logprobs
    g = torch.Generator().manual_seed(seed)
    lp0 = old + 0.3 * torch.randn(old.shape, generator=g)
    adv_tok = adv[batch.rollout_index][:, None].expand(mask.shape).contiguous()
    w = token_weights(mask, batch.rollout_index, mode=mode, norm_length=norm(mode))
    config = actor_config()
    config.global_batch_info["dp_size"] = dp_size

    lp = lp0.clone().requires_grad_(True)
    ours, metrics = get_policy_loss_fn(mode)(old, lp, adv_tok, mask, "token-mean", config, w)
    ours.backward()
    lp_ref = lp0.clone().requires_grad_(True)
    ref, m = policy_loss(lp_ref, old, adv_tok, w, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    ref.backward()
    # the same per-token fp32 formulas, summed in another order (a few u = 6e-8 of sum |w l|):
    # rel 1e-5 (~170 u) whatever the CPU's kernels
    assert ours.item() == pytest.approx(dp_size * ref.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(lp.grad, dp_size * lp_ref.grad, rtol=1e-5, atol=1e-7)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(m["clip_frac"]), abs=1e-6)

    # verl's own PPO surrogate, weighted by the same w and aggregated by verl's "token-sum"
    # (masked sum * dp_size): an independent implementation of the same number.
    vanilla, _ = compute_policy_loss_vanilla(old, lp0, adv_tok, mask, "token-sum", config, w)
    assert float(vanilla) == pytest.approx(float(ours), rel=1e-5, abs=1e-6)

    # The rows cut anywhere into two micro-batches add up to the same loss.
    k = cut % batch.n_rows
    parts = [slice(0, k), slice(k, None)]
    total = sum(
        float(
            get_policy_loss_fn(mode)(
                old[s], lp0[s], adv_tok[s], mask[s], "token-mean", config, w[s]
            )[0]
        )
        for s in parts
    )
    assert total == pytest.approx(float(ours), rel=1e-5, abs=1e-6)


def test_registered_loss_refuses_what_would_break_the_invariants():
    batch, _, adv, _ = training_batch([2, 1], seed=3)
    mask, old = batch.response_mask, batch.rollout_logprobs
    adv_tok = adv[batch.rollout_index][:, None].expand(mask.shape)
    w = token_weights(mask, batch.rollout_index)
    fn = get_policy_loss_fn("rollout-mean")
    with pytest.raises(ValueError, match="token weights in the batch key 'rollout_is_weights'"):
        fn(old, old, adv_tok, mask, "token-mean", actor_config(), None)
    with pytest.raises(ValueError, match="invariant 5"):
        fn(old, old, adv_tok, mask, "token-mean", actor_config(use_kl_loss=True), w)
    with pytest.raises(ValueError, match="invariant 5"):
        fn(old, old, adv_tok, mask, "token-mean", actor_config(entropy_coeff=0.01), w)
    with pytest.raises(ValueError, match="checked against"):
        fn(old, old, adv_tok, mask, "token-mean", actor_config(strategy="megatron"), w)
    with pytest.raises(ValueError, match="shape"):
        fn(old, old, adv_tok, mask, "token-mean", actor_config(), w[:, :3])


# --------------------------------------------------------------------------- verl's real actor
def actor_config_for(section, mode: str):
    """verl's ActorConfig from the actor section of the config tracetrain built, with
    policy_loss.loss_mode = mode (how a run selects the registered loss)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    section = section.copy()
    OmegaConf.update(section, "policy_loss.loss_mode", mode)
    return omega_conf_to_dataclass(section)


@pytest.fixture(scope="module")
def verl_actor(tmp_path_factory):
    """verl's TrainingWorker on a tiny Qwen2 (same weights as tiny_causal_lm(0)), built from the
    verl config tracetrain makes; yields (worker, captured gradients, actor configs)."""
    from verl_cpu import CPU_OVERRIDES, actor_worker, capture_gradients, init_gloo, use_cpu

    from tracetrain.config import build_config
    from tracetrain.integrations.verl.config import VerlConfig, build_verl_config
    from tracetrain.models.tiny import build_tokenizer

    model_dir = tmp_path_factory.mktemp("tiny")
    tiny_causal_lm(seed=0).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    saved_env = {
        k: os.environ.get(k)
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GLOO_SOCKET_IFNAME",
        )
    }
    use_cpu()
    init_gloo()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def actor_section(**loss):
        cfg = build_config(
            {
                "model": {"kind": "pretrained", "path": str(model_dir)},
                "optim": {"lr": 1e-12, "weight_decay": 0.0, "grad_clip": 1e9, "warmup_steps": 0},
                "loss": {"clip_high": 0.28, **loss},
            }
        )
        return build_verl_config(cfg, VerlConfig(overrides=CPU_OVERRIDES)).actor_rollout_ref.actor

    sections = {
        "plain": actor_section(),
        "kl_entropy": actor_section(kl_coef=KL_COEF, entropy_coef=ENTROPY_COEF),
    }
    configs = functools.cache(lambda kind, mode: actor_config_for(sections[kind], mode))
    worker = actor_worker(str(model_dir), configs("plain", "rollout-mean"), micro_batch_size=2)
    grads = capture_gradients(worker)
    try:
        yield worker, grads, configs
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def set_micro_batches(worker, micro) -> int:
    """micro: an int (rows per micro-batch), or "dynamic" (a 24-token budget). Returns the
    rows_multiple the layout needs (verl's fixed micro-batches must divide a rank's mini-batch)."""
    engine = worker.engine_config
    engine.use_dynamic_bsz = micro == "dynamic"
    engine.micro_batch_size_per_gpu = None if micro == "dynamic" else micro
    engine.max_token_len_per_gpu = 24
    return 1 if micro == "dynamic" else micro


def tracetrain_gradients(batch, rows, adv, ref, *, mode, n_mini_batches, kl_entropy=False):
    """ppo_update-style: plan_step over the step, one mini-batch = one policy_loss on all its rows
    with RowWeights(mask, the mini-batch's row scales); returns [(loss, grads)] per mini-batch."""
    model = tiny_causal_lm(seed=0)
    plan = plan_step(
        batch.response_mask,
        batch.rollout_index,
        n_mini_batches=min(n_mini_batches, batch.n_rollouts),
        mode=mode,
        norm_length=norm(mode),
        row_tokens=batch.attention_mask.sum(1),
    )
    out = []
    for mb in plan:
        model.zero_grad()
        lp, ent = logprobs_and_entropy(model, rows, mb.rows)
        extra = {}
        if kl_entropy:
            extra = dict(
                ref_logprobs=ref[mb.rows],
                kl_coef=KL_COEF,
                kl_estimator="k3",
                entropy=ent,
                entropy_coef=ENTROPY_COEF,
            )
        loss, _ = policy_loss(
            lp,
            batch.rollout_logprobs[mb.rows],
            adv[batch.rollout_index][mb.rows],
            RowWeights(batch.response_mask[mb.rows], mb.row_scales),
            clip_low=0.2,
            clip_high=0.28,
            dual_clip=3.0,
            **extra,
        )
        loss.backward()
        out.append((loss.item(), [p.grad.detach().clone() for p in model.parameters()]))
    return out


def moves(expected) -> bool:
    """A gradient worth comparing: some entry above the tolerances below (a mini-batch whose
    tokens are all clipped has none, legitimately)."""
    return any(float(e.abs().max()) > 1e-4 for e in expected)


def assert_same_gradients(got, expected):
    """Parameter gradients of one step computed two ways: the same per-token terms through
    matmuls of other batch shapes (K <= 64 per dot in the tiny model) and accumulated over
    micro-batches / ranks in another order: <~ 100 u = 6e-6 relative per entry on any CPU's
    kernels; rtol 1e-4 has ~20x room, atol 1e-6 covers entries that cancel to ~0."""
    for a, e in zip(got, expected, strict=True):
        assert torch.allclose(a, e, rtol=1e-4, atol=1e-6), float((a - e).abs().max())


def run_verl(verl_actor, batch, adv, ref, *, mode, n_mini_batches, micro, loss="registered"):
    worker, grads, configs = verl_actor
    rows_multiple = set_micro_batches(worker, micro)
    kl_entropy = loss == "full"
    if kl_entropy:  # tracetrain's verl loss function: surrogate, KL and entropy with the same w
        worker.set_loss_fn(
            functools.partial(verl_loss.ppo_loss, config=configs("kl_entropy", mode))
        )
    else:  # verl's own ppo_loss, which calls get_policy_loss_fn(policy_loss.loss_mode)
        from verl.workers.utils.losses import ppo_loss

        worker.set_loss_fn(functools.partial(ppo_loss, config=configs("plain", mode)))
    proto = to_dataproto(
        batch,
        adv,
        mode=mode,
        norm_length=norm(mode),
        n_mini_batches=n_mini_batches,
        rows_multiple=rows_multiple,
        ref_log_probs=ref if kl_entropy else None,
    )
    grads.clear()
    metrics = update_actor(LocalActorGroup(worker), proto, calculate_entropy=kl_entropy)
    return list(grads), metrics


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(
    rows_per_rollout=st.lists(st.integers(1, 3), min_size=2, max_size=5),
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(MODE_NAMES),
    n_mini_batches=st.integers(1, 2),
    micro=st.sampled_from([1, 2, 3, "dynamic"]),
)
def test_verl_actor_gradient_equals_tracetrain(
    verl_actor, rows_per_rollout, seed, mode, n_mini_batches, micro
):
    batch, rows, adv, ref = training_batch(rows_per_rollout, seed=seed, model=tiny_causal_lm(0))
    got, metrics = run_verl(
        verl_actor, batch, adv, ref, mode=mode, n_mini_batches=n_mini_batches, micro=micro
    )
    expected = tracetrain_gradients(batch, rows, adv, ref, mode=mode, n_mini_batches=n_mini_batches)
    assert len(got) == len(expected)  # one optimizer step per tracetrain mini-batch
    assume(any(moves(e) for _, e in expected))  # else there is nothing to compare
    for g, (_, e) in zip(got, expected, strict=True):
        assert_same_gradients(g, e)
    assert metrics["actor/pg_loss"] == pytest.approx(
        [loss for loss, _ in expected], rel=1e-4, abs=1e-6
    )


@pytest.mark.slow
def test_micro_batch_size_does_not_change_the_gradient(verl_actor):
    batch, rows, adv, ref = training_batch([3, 1, 2, 2], seed=7, model=tiny_causal_lm(0))
    (expected,) = tracetrain_gradients(batch, rows, adv, ref, mode="rollout-mean", n_mini_batches=1)
    assert moves(expected[1])
    for micro in (1, 2, batch.n_rows, "dynamic"):  # batch.n_rows: one micro-batch holds all
        (got,), _ = run_verl(
            verl_actor, batch, adv, ref, mode="rollout-mean", n_mini_batches=1, micro=micro
        )
        assert_same_gradients(got, expected[1])


@pytest.mark.slow
def test_full_loss_with_kl_and_entropy_equals_tracetrain(verl_actor):
    batch, rows, adv, ref = training_batch([2, 3, 1], seed=11, model=tiny_causal_lm(0))
    expected = tracetrain_gradients(
        batch, rows, adv, ref, mode="rollout-mean", n_mini_batches=2, kl_entropy=True
    )
    got, metrics = run_verl(
        verl_actor, batch, adv, ref, mode="rollout-mean", n_mini_batches=2, micro=1, loss="full"
    )
    assert any(moves(e) for _, e in expected)
    for g, (_, e) in zip(got, expected, strict=True):
        assert_same_gradients(g, e)
    total = [
        a - ENTROPY_COEF * h + KL_COEF * k
        for a, h, k in zip(
            metrics["actor/pg_loss"], metrics["actor/entropy_loss"], metrics["kl_loss"], strict=True
        )
    ]
    assert total == pytest.approx([loss for loss, _ in expected], rel=1e-4, abs=1e-6)
    assert metrics["actor/weight_mass"] == pytest.approx([1.0, 1.0], abs=1e-5)


# --------------------------------------------------------------------------- 2 data-parallel ranks
WORLD = 2
DEADLINE_S = 300
DP_CASES = [("rollout-mean", 2, 1), ("seq-mean-token-mean", 1, "dynamic")]


def _dp_worker(rank: int, init_method: str, out: str, model_dir: str) -> None:
    """One dp rank: verl's TrainingWorker on its chunk of the batch (as verl's dispatch gives it:
    BatchData.chunk, then serialized like a Ray argument); FSDP2 all-reduces over gloo."""
    torch.set_num_threads(1)
    from verl.protocol import BatchData
    from verl.workers.utils.losses import ppo_loss
    from verl_cpu import CPU_OVERRIDES, actor_worker, capture_gradients, init_gloo, use_cpu

    from tracetrain.config import build_config
    from tracetrain.integrations.verl.config import VerlConfig, build_verl_config

    use_cpu()
    init_gloo(rank, WORLD, init_method)
    cfg = build_config(
        {
            "model": {"kind": "pretrained", "path": model_dir},
            "optim": {"lr": 1e-12, "weight_decay": 0.0, "grad_clip": 1e9, "warmup_steps": 0},
            "loss": {"clip_high": 0.28},
        }
    )
    section = build_verl_config(cfg, VerlConfig(overrides=CPU_OVERRIDES)).actor_rollout_ref.actor
    worker = actor_worker(model_dir, actor_config_for(section, "rollout-mean"), micro_batch_size=1)
    grads = capture_gradients(worker)

    class RankGroup:
        def update_actor(self, td):
            chunk = BatchData(td).chunk(WORLD)[rank]
            return worker.train_mini_batch(pickle.loads(pickle.dumps(chunk)))

    result = {}
    for mode, _, micro in DP_CASES:
        config = actor_config_for(section, mode)
        worker.set_loss_fn(functools.partial(ppo_loss, config=config))
        set_micro_batches(worker, micro)
        proto = torch.load(Path(out) / f"{mode}.pt", weights_only=False)
        grads.clear()
        metrics = update_actor(RankGroup(), proto)
        result[mode] = (list(grads), [float(x) for x in metrics["actor/pg_loss"]])
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_data_parallel_ranks_give_the_single_process_gradient(tmp_path):
    from tracetrain.models.tiny import build_tokenizer

    model_dir = tmp_path / "tiny"
    tiny_causal_lm(seed=0).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    batch, rows, adv, ref = training_batch([2, 1, 3, 1, 2], seed=5, model=tiny_causal_lm(0))
    for mode, n_mb, micro in DP_CASES:
        proto = to_dataproto(
            batch,
            adv,
            mode=mode,
            n_mini_batches=n_mb,
            dp_size=WORLD,
            rows_multiple=1 if micro == "dynamic" else micro,
        )
        torch.save(proto, tmp_path / f"{mode}.pt")
    run_ranks(_dp_worker, (str(tmp_path), str(model_dir)), WORLD, DEADLINE_S, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{k}.pt") for k in range(WORLD)]
    for mode, n_mb, _ in DP_CASES:
        expected = tracetrain_gradients(batch, rows, adv, ref, mode=mode, n_mini_batches=n_mb)
        assert any(moves(e) for _, e in expected)
        for result in ranks:
            got, pg_loss = result[mode]
            assert len(got) == len(expected)
            for g, (_, e) in zip(got, expected, strict=True):
                assert_same_gradients(g, e)
            # verl's metric: each rank's dp-scaled sum, averaged over ranks = the mini-batch's loss
            assert pg_loss == pytest.approx([loss for loss, _ in expected], rel=1e-4, abs=1e-6)
