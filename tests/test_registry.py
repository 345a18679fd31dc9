"""The registries are the single source of the names a config accepts (tracetrain/registry.py):
aliases resolve, unknown names are refused with every known name, and a user's module named in
`plugins` registers an estimator and a loss mode that a YAML config then trains with, in one
process and on two DDP ranks (torchrun)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tracetrain import registry
from tracetrain.config import ConfigError, build_config, config_reference, load_config
from tracetrain.objective.advantage import ESTIMATORS, rollout_advantages
from tracetrain.objective.weights import MODES

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = Path(__file__).resolve().parent / "support" / "plugin_pieces.py"
DEADLINE_S = 300


def test_the_alias_is_stored_as_the_name_it_stands_for():
    aliased = build_config({}, ["loss.mode=per_rollout_mean"])
    assert aliased.loss.mode == "rollout-mean"
    assert aliased == build_config({}, ["loss.mode=rollout-mean"])  # the same run
    cfg = build_config({})
    cfg.loss.mode = "per_rollout_mean"  # assignment is validated the same way
    assert cfg.loss.mode == "rollout-mean"


@pytest.mark.parametrize("key, names", [
    ("advantage.estimator", ["grpo", "dr-grpo", "rloo", "reinforce++", "return-to-go", "gigpo"]),
    ("loss.mode", ["rollout-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                   "seq-mean-token-sum-norm", "per_rollout_mean"]),
    ("loss.kl_estimator", ["k1", "k2", "k3"]),
    ("correction.weight", ["none", "token", "rollout"]),
    ("correction.mask", ["none", "token", "rollout"]),
    ("engine.kind", ["local", "vllm"]),
    ("env.kind", ["reasoning_gym", "verifiers", "environment_class", "openenv"]),
])
def test_an_unknown_name_is_refused_with_every_known_one(key, names):
    with pytest.raises(ConfigError) as e:
        build_config({}, [f"{key}=nope"])
    assert str(e.value) == (f"config key {key!r}: unknown {registry.KEYS[key][0].what} 'nope'; "
                            f"known: {', '.join(names)}")
    # and docs/config.md lists exactly those names for the key
    row = next(line for line in config_reference().splitlines() if line.startswith(f"| `{key}` |"))
    assert all(f"`{n}`" in row for n in names)


def test_a_name_cannot_be_taken_twice_and_an_alias_is_not_a_name(clean_registries):
    def other(*a):  # pragma: no cover
        raise AssertionError

    before = MODES["rollout-mean"]
    with pytest.raises(ValueError, match="loss.mode: 'rollout-mean' is registered already "
                                         "\\(tracetrain.objective.weights._rollout_mean\\)"):
        MODES.register("rollout-mean")(other)
    assert MODES["rollout-mean"] is before
    MODES.register("rollout-mean")(before)  # the same piece again (a module imported twice): kept
    with pytest.raises(ValueError, match="'per_rollout_mean' is an alias of 'rollout-mean'"):
        MODES.register("per_rollout_mean")(lambda *a: None)


def test_plugins_from_a_yaml_config_register_names_relative_to_the_config(tmp_path, monkeypatch,
                                                                           clean_registries):
    monkeypatch.chdir(tmp_path)  # not where the config is: the path is taken from the config file
    (tmp_path / "conf" / "mine").mkdir(parents=True)
    shutil.copy(PLUGIN, tmp_path / "conf" / "mine" / "pieces.py")
    path = tmp_path / "conf" / "run.yaml"
    path.write_text(yaml.safe_dump({"plugins": ["mine/pieces.py"],
                                    "advantage": {"estimator": "sign"},
                                    "loss": {"mode": "half-rollout-mean"}}))
    cfg = load_config(path)
    assert (cfg.advantage.estimator, cfg.loss.mode) == ("sign", "half-rollout-mean")
    assert cfg.plugins == [str((tmp_path / "conf" / "mine" / "pieces.py").resolve())]
    # the run's config.json (its dump) builds again from anywhere: the plugin path is absolute
    assert build_config(json.loads(cfg.model_dump_json())) == cfg
    # the registered estimator is the one the step calls
    adv = rollout_advantages([1.0, 0.0, 0.5, 2.0], ["a", "a", "b", "b"], estimator="sign")
    assert adv.values.tolist() == [1.0, -1.0, -1.0, 1.0]
    assert "sign" in ESTIMATORS and "sign" in registry.known("advantage.estimator")
    # tracetrain's own names only in docs/config.md, whatever a process has imported
    assert "half-rollout-mean" not in config_reference()


def test_a_plugin_kl_estimator_runs_where_the_cpu_fast_path_has_no_derivative(clean_registries):
    """A registered KL without a derivative in loss_cpu.KL_GRADS: the plain loss, not a KeyError."""
    import torch

    from tracetrain.objective.loss import policy_loss, register_kl

    register_kl("k1-again")(lambda logprob, ref: logprob - ref)
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 6, generator=g, requires_grad=True)
    old, ref, adv = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(4)
    w = torch.full((4, 6), 1 / 24)
    got = policy_loss(lp, old, adv, w, ref_logprobs=ref, kl_coef=0.1, kl_estimator="k1-again",
                      chunk_tokens=8)  # chunk_tokens asks for the CPU path
    want = policy_loss(lp, old, adv, w, ref_logprobs=ref, kl_coef=0.1, kl_estimator="k1")
    assert torch.equal(got[0], want[0])


def test_a_plugin_that_is_missing_or_broken_is_named(tmp_path, clean_registries):
    with pytest.raises(ConfigError, match="config key 'plugins': no module named 'no_such_mod'"):
        build_config({"plugins": ["no_such_mod"]})
    with pytest.raises(ConfigError, match="config key 'plugins': no file 'gone.py'"):
        build_config({"plugins": ["gone.py"]}, base_dir=tmp_path)
    broken = tmp_path / "broken.py"
    broken.write_text("raise ValueError('my bug')\n")
    with pytest.raises(ImportError, match="importing .*broken.py' failed: ValueError\\('my bug'\\)") as e:
        build_config({"plugins": [str(broken)]})
    assert isinstance(e.value.__cause__, ValueError)  # its traceback is kept, not a config line
    with pytest.raises(ConfigError, match="config key 'plugins': for backend 'embedded'"):
        build_config({"plugins": ["json"], "backend": "verl",
                      "model": {"kind": "pretrained", "path": "x"}})


def run(cmd: list[str], env: dict) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE_S,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "warm_start.steps=2", "warm_start.batch_size=8", "rollout.tasks_per_step=2",
         "rollout.n_per_task=4", "optim.warmup_steps=0", "optim.mini_batches=1",
         "trainer.steps=1", "trainer.seed=3", "trainer.eval_every=0", "engine.threads=1",
         "trainer.collect=step", "trainer.precision=fp32"]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_plugin_estimator_and_loss_mode_train_a_step(tmp_path, ranks):
    """`tracetrain train` in a fresh process (and under torchrun, in each rank): the names come
    from the YAML config's plugin alone, the plugin's functions run, and the update has the mass
    the plugin's mode gives (1/2, where every built-in mean mode gives 1)."""
    (tmp_path / "mine").mkdir()
    shutil.copy(PLUGIN, tmp_path / "mine" / "pieces.py")
    config = tmp_path / "run.yaml"
    example = yaml.safe_load((ROOT / "examples" / "guess" / "config.yaml").read_text())
    example.update(task=str(ROOT / "examples" / "guess" / "task.py"), plugins=["mine/pieces.py"])
    example.setdefault("advantage", {})["estimator"] = "sign"
    example.setdefault("loss", {})["mode"] = "half-rollout-mean"
    config.write_text(yaml.safe_dump(example))
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PLUGIN_CALLS": str(calls), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    launch = ([sys.executable] if ranks == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--standalone"])
    run([*launch, "-m", "tracetrain", "train", str(config), *SMALL,
         f"trainer.run_dir={tmp_path / 'run'}"], env)
    (m,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert m["loss/weight_mass"] == pytest.approx(0.5, abs=1e-5)
    assert m["loss/rollout_mass_x_R_min"] == pytest.approx(0.5, abs=1e-5)
    lines = calls.read_text().split()
    who = {(what, rank) for what, rank in zip(lines[::2], lines[1::2], strict=True)}
    if ranks == 1:
        assert who == {("estimator", "-"), ("mode", "-")}
    else:  # every rank weighs its shard with the plugin's mode; the step's advantages are rank 0's
        assert {("mode", str(r)) for r in range(ranks)} <= who
        assert any(what == "estimator" for what, _ in who)
