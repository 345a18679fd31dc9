"""Data-parallel embedded training on a real torch.distributed gloo group (two processes on
loopback): two optimizer steps of `ppo_update` under DDP (2 mini-batches, small micro-batches,
grad clipping, AdamW, KL to a reference) leave the same weights as one process on the same data;
and `torchrun -m tracetrain train` runs the guess demo on 2 ranks to the same weights as 1 process.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import join_gloo, leave_gloo, run_ranks

from tracetrain.config import build_config
from tracetrain.learn.distributed import DataParallel, wrap_policies
from tracetrain.learn.update import ppo_update
from tracetrain.models import lora, tiny
from tracetrain.rows.aggregate import aggregate
from tracetrain.run import policies
from tracetrain.run.policies import ByPolicy
from tracetrain.run.step import Rows
from tracetrain.types import Rollout, Turn

WORLD = 2
DEADLINE_S = 240
ROOT = Path(__file__).resolve().parents[2]


def step_batches(seed: int = 7):
    """Two steps of random multi-turn rollouts (some with a prefix break, so rows per rollout
    vary), their batches and per-rollout advantages; the same on every process."""
    rng = random.Random(seed)
    out = []
    for step in range(2):
        rollouts = []
        for k in range(10):
            turns, context = [], []
            for _ in range(rng.randint(1, 3)):
                obs = [rng.randint(3, 90) for _ in range(rng.randint(1, 4))]
                prompt = (context if rng.random() < 0.7 else context[:1]) + obs
                resp = [rng.randint(3, 90) for _ in range(rng.randint(1, 5))]
                turns.append(Turn(prompt, resp, [-rng.random() - 0.1 for _ in resp]))
                context = prompt + resp
            rollouts.append(Rollout(f"s{step}-r{k}", f"s{step}-g{k // 4}", turns,
                                    reward=float(rng.random() < 0.5)))
        batch, _ = aggregate(rollouts, max_prompt_length=64, max_response_length=32)
        g = torch.Generator().manual_seed(step)
        out.append((batch, torch.randn(batch.n_rollouts, generator=g)))
    return out


def config():
    return build_config({}, ["optim.mini_batches=2", "optim.micro_batch_tokens=24", "optim.grad_clip=0.003",
                             "loss.kl_coef=0.1", "loss.entropy_coef=0.01"])


def models():
    tok = tiny.build_tokenizer()
    policy = tiny.build_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
    return policy, copy.deepcopy(policy).requires_grad_(False)


def train_two_steps(dp: DataParallel) -> tuple[dict, list]:
    torch.set_num_threads(1)
    policy, ref = models()
    model = torch.nn.parallel.DistributedDataParallel(policy) if dp.enabled else policy
    # SGD with momentum: the update is linear in the gradient, so equal gradients must give equal
    # weights to fp32 rounding (Adam's first steps are ~lr * sign(g): fp noise in a near-zero
    # gradient would flip whole steps; the torchrun test below runs the config's AdamW).
    opt = torch.optim.SGD(policy.parameters(), lr=0.5, momentum=0.9)
    cfg = config()
    results = []
    for batch, adv in step_batches():
        results += ppo_update(model, opt, batch, adv, cfg, ref_model=ref, dp=dp)
    return policy.state_dict(), [(r.loss, r.grad_norm, r.metrics) for r in results]


def policies_config():
    return build_config({"policies": {"pa": {"roles": ["x"], "lora": {"r": 4, "alpha": 8}},
                                      "pb": {"roles": ["y"], "lora": {"r": 2, "alpha": 4}, "grad_clip": 0.01},
                                      "pc": {"roles": ["z"], "lora": None}}},
                        ["optim.mini_batches=2", "optim.micro_batch_tokens=24", "optim.grad_clip=0.003",
                         "loss.kl_coef=0.1", "loss.entropy_coef=0.01"])


def policies_model(cfg):
    """The tiny model with fresh adapters pa and pb (their init seeded: the same in every
    process), and pc's whole model (a copy of the tiny model)."""
    base, _ = models()
    whole = {"pc": copy.deepcopy(base)}
    torch.manual_seed(0)
    return lora.wrap_policies(base, cfg.adapter_policies), whole


def train_two_policies(dp: DataParallel) -> tuple[dict, list]:
    """Three policies (adapters pa and pb on one base, pc a whole model), two steps of
    run/policies.update: step 0 all have rows, step 1 pb none (its wrapper then joins no
    collective on any rank)."""
    torch.set_num_threads(1)
    cfg = policies_config()
    model, whole = policies_model(cfg)
    refs = {"pa": copy.deepcopy(model).requires_grad_(False),
            "pc": copy.deepcopy(whole["pc"]).requires_grad_(False)}
    refs["pb"] = refs["pa"]
    names = ["pa", "pb", "pc"]
    forwards = wrap_policies(model, ["pa", "pb"], dp, whole)
    params = {"pa": lora.policy_parameters(model, "pa"), "pb": lora.policy_parameters(model, "pb"),
              "pc": list(whole["pc"].parameters())}
    opts = ByPolicy({n: torch.optim.SGD(params[n], lr=0.5, momentum=0.9) for n in names})
    results = []
    for step, ((ba, aa), (bb, ab), (bc, ac)) in enumerate(zip(step_batches(7), step_batches(8),
                                                               step_batches(9), strict=True)):
        if step == 1:  # b's roles made no trained call
            bb, ab = aggregate([], max_prompt_length=64, max_response_length=32)[0], ab[:0]
        parts = {"pa": Rows(ba, aa, {}), "pb": Rows(bb, ab, {}), "pc": Rows(bc, ac, {})}
        out = policies.update(forwards, parts, opts, ByPolicy(dict.fromkeys(names)), cfg,
                              refs=refs, measure_gap=False, dp=dp)
        results += [(n, r.loss, r.grad_norm) for n, rs in out.items() for r in rs]
    del forwards
    return {**lora.weights(model), "pc": whole["pc"].state_dict()}, results


def _worker(rank: int, init_method: str, out: str, what: str = "one") -> None:
    join_gloo(init_method, rank, WORLD)
    try:
        train = train_two_steps if what == "one" else train_two_policies
        torch.save(train(DataParallel(WORLD, rank)), Path(out) / f"rank{rank}.pt")
    finally:
        leave_gloo()  # after the training's DDP wrappers are gone


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two ranks vs one process: the same fp32 terms summed in another order (matmuls over half
    the rows, gradients all-reduced): <~ 100 u = 6e-6 relative per entry after two AdamW steps
    (its update is ~lr per entry, so a relative gradient error moves a weight by ~lr * that);
    rtol 1e-4 has ~20x room on any CPU, atol 1e-6 covers entries near 0."""
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_two_ranks_take_the_same_optimizer_steps_as_one_process(tmp_path):
    run_ranks(_worker, (str(tmp_path),), WORLD, DEADLINE_S, tmp_path)
    expected, expected_results = train_two_steps(DataParallel())
    initial, _ = models()
    assert len(expected_results) == 4  # 2 steps x 2 mini-batches
    moved = [k for k, v in expected.items() if not torch.equal(v, initial.state_dict()[k])]
    assert moved  # the updates did something
    assert any(g > 0.003 for _, g, _ in expected_results)  # clipping was active on some update
    for rank in range(WORLD):
        weights, results = torch.load(tmp_path / f"rank{rank}.pt")
        for k, v in expected.items():
            assert close(weights[k], v), (rank, k)
        # The logged figures are whole-mini-batch figures on every rank, as with one process.
        for (loss, gn, m), (eloss, egn, em) in zip(results, expected_results, strict=True):
            assert loss == pytest.approx(eloss, rel=1e-4, abs=1e-6)
            assert gn == pytest.approx(egn, rel=1e-4)
            for key in ("pg_loss", "weight_mass", "kl_ref", "entropy", "clip_frac", "n_rollouts"):
                assert m[key] == pytest.approx(em[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_two_ranks_update_each_policy_as_one_process_does(tmp_path):
    """Several policies under DDP: a wrapper per adapter and per whole model
    (distributed.wrap_policies), each policy's gradient all-reduced alone; the adapters and the
    whole model equal the one-process run's on every rank, a step in which a policy has no rows
    included."""
    run_ranks(_worker, (str(tmp_path), "policies"), WORLD, DEADLINE_S, tmp_path)
    expected, expected_results = train_two_policies(DataParallel())
    assert [n for n, *_ in expected_results] == ["pa", "pa", "pb", "pb", "pc", "pc", "pa", "pa", "pc", "pc"]
    model, whole = policies_model(policies_config())
    start = {**lora.weights(model), "pc": whole["pc"].state_dict()}
    for name in ("pa", "pb", "pc"):  # {policy: its adapter's weights, or its whole model's}
        assert any(not torch.equal(v, start[name][k]) for k, v in expected[name].items()), name
    for rank in range(WORLD):
        weights, results = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ("pa", "pb", "pc"):
            for k, v in expected[name].items():
                assert close(weights[name][k], v), (rank, name, k)
        for (n, loss, gn), (en, eloss, egn) in zip(results, expected_results, strict=True):
            assert n == en
            assert loss == pytest.approx(eloss, rel=1e-4, abs=1e-6)
            assert gn == pytest.approx(egn, rel=1e-4)


def run_cli(cmd: list[str], cwd: Path, env: dict) -> None:
    """Run cmd in its own process group; on overrun the whole group (torchrun and its ranks) is
    killed and reaped, and the test fails with the output so far."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[2:5]} did not finish in {DEADLINE_S} s:\n{out[-3000:]}", pytrace=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # no rank outlives its launcher
    assert proc.returncode == 0, out[-3000:]


@pytest.mark.slow
def test_torchrun_two_ranks_train_the_demo_like_one_process(tmp_path):
    example = ROOT / "examples" / "guess"
    overrides = [
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "warm_start.steps=3", "warm_start.batch_size=8",
        "rollout.tasks_per_step=3", "rollout.n_per_task=4", "rollout.timeout_s=60",
        "optim.lr=1e-2", "optim.warmup_steps=0", "optim.mini_batches=2", "optim.micro_batch_tokens=64",
        "trainer.steps=2", "trainer.seed=3", "trainer.eval_every=0", "engine.threads=1",
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli([sys.executable, "-m", "tracetrain", "train", str(example / "config.yaml"),
             *overrides, f"trainer.run_dir={one}"], ROOT, env)
    run_cli([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--standalone",  # the launcher's own store on a port it binds itself: no race
             "-m", "tracetrain", "train", str(example / "config.yaml"),
             *overrides, f"trainer.run_dir={two}"], ROOT, env)
    m1 = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in m2] == [0, 1]  # rank 0 alone writes metrics, once per step
    assert [m["model_version"] for m in m2] == [1, 2]
    # Step 0 sees the same rollouts on both runs (same seed, same warm start on rank 0).
    assert m2[0]["reward_mean"] == m1[0]["reward_mean"]
    assert m2[0]["aggregate/n_rows"] == m1[0]["aggregate/n_rows"]
    assert m2[0]["loss"] == pytest.approx(m1[0]["loss"], rel=1e-4, abs=1e-6)
    w1 = torch.load(one / "checkpoint.pt", weights_only=False)["model"]
    w2 = torch.load(two / "checkpoint.pt", weights_only=False)["model"]
    # AdamW's first steps move each weight by about lr * sign(g), so fp noise in a near-zero
    # gradient could flip one weight's step (2 * lr): bound the worst weight by that, and the
    # typical weight far below it.
    lr = 1e-2
    for k, v in w1.items():
        diff = (w2[k] - v).abs()
        assert diff.max() <= 2 * lr * 4, k  # 4 optimizer updates
        assert diff.mean() <= 1e-3 * lr, k


@pytest.mark.slow
def test_torchrun_two_ranks_train_two_policies_like_one_process(tmp_path):
    """`policies` under torchrun (the solver an adapter, the checker a whole model): each rank
    takes rank 0's rows of every policy and updates each through its own DDP wrapper; the
    adapter and the whole model end as the one-process run's."""
    support = ROOT / "tests" / "support"
    config = tmp_path / "two_policies.yaml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "task": str(support / "two_roles_task.py"),
        "policies": {"solver": {"roles": ["solver"], "lora": {"r": 4, "alpha": 8}},
                     "checker": {"roles": ["checker"], "lora": None, "lr": 3e-3}},
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1},
        "rollout": {"tasks_per_step": 2, "n_per_task": 3, "max_tokens": 5, "agent_workers": 0},
        "advantage": {"estimator": "return-to-go"},
        "optim": {"lr": 2e-2, "warmup_steps": 0, "mini_batches": 2, "micro_batch_tokens": 64},
        "trainer": {"steps": 2, "seed": 3, "eval_every": 0}, "engine": {"threads": 1}}))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli([sys.executable, "-m", "tracetrain", "train", str(config), f"trainer.run_dir={one}"], ROOT, env)
    run_cli([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
             "-m", "tracetrain", "train", str(config), f"trainer.run_dir={two}"], ROOT, env)
    m1 = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [m["model_version"] for m in m2] == [1, 2]
    for name in ("solver", "checker"):  # step 0: the same rollouts, each policy's same loss
        assert m2[0][f"policy/{name}/aggregate/n_rows"] == m1[0][f"policy/{name}/aggregate/n_rows"] > 0
        assert m2[0][f"policy/{name}/loss"] == pytest.approx(m1[0][f"policy/{name}/loss"], rel=1e-4, abs=1e-6)
    c1, c2 = (torch.load(run / "checkpoint.pt", weights_only=False) for run in (one, two))
    w1, w2 = {**c1["model"], **c1["whole"]}, {**c2["model"], **c2["whole"]}
    assert sorted(w1) == sorted(w2) == ["checker", "solver"]
    # it learned (B starts at 0)
    assert any(v.abs().max() > 0 for k, v in w1["solver"].items() if "lora_B" in k)
    for name, lr in (("solver", 2e-2), ("checker", 3e-3)):  # AdamW moves a weight by ~lr per update
        for k, v in w1[name].items():
            diff = (w2[name][k] - v).abs()
            assert diff.max() <= 2 * lr * 4, (name, k)  # 4 optimizer updates
            assert diff.mean() <= 1e-3 * lr, (name, k)


def test_sigterm_to_every_rank_stops_them_all_with_the_checkpoint_of_rank_0(tmp_path):
    """A scheduler's SIGTERM to each rank of a torchrun job: rank 0 stops at its next stop point
    and checkpoints, tells the other ranks, and every rank exits 0 (before: the other ranks waited
    on rank 0's next broadcast until the grace ended them with 1)."""
    import time

    example = ROOT / "examples" / "guess"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "tracetrain", "train", str(example / "config.yaml"),
         "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "warm_start.steps=3", "warm_start.batch_size=8", "rollout.tasks_per_step=3",
         "rollout.n_per_task=4", "trainer.steps=100000", "trainer.eval_every=0",
         "trainer.checkpoint_minutes=0", "engine.threads=1", f"trainer.run_dir={run}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        end = time.monotonic() + DEADLINE_S
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < end, "no step in time"
            time.sleep(0.2)
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2
        t = time.monotonic()
        for pid in ranks:
            os.kill(int(pid), signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-3000:]
        assert time.monotonic() - t < 15  # well inside the grace (20 s)
        steps = len((run / "metrics.jsonl").read_text().splitlines())
        assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == steps
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
