"""Config errors name the bad key; values are typed, never coerced from the wrong type."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tracetrain.config import ConfigError, TrainConfig, build_config, load_config, parse_overrides


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lrr=1e-3", "optim.lrr"),
        ("trainer.steps=abc", "trainer.steps"),
        ("trainer.steps=true", "trainer.steps"),
        ("trainer.steps=0", "trainer.steps"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("loss.mode=sum-of-everything", "loss.mode"),
        ("aggregate.level=episode", "aggregate.level"),
        ("nonsense=1", "nonsense"),
        ("rollout=3", "rollout"),
        ("gateway.port=70000", "gateway.port"),
        ("gateway.public_url=ftp://x", "gateway.public_url"),
        ("gateway.public_url=http://h:{prot}", "gateway.public_url"),
        ("gateway.host=0.0.0.0", "gateway.public_url"),  # a wildcard is no URL to hand to agents
    ],
)
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        build_config({}, [override])
    assert f"'{key}'" in str(e.value)


def test_cross_field_rules_name_the_keys():
    with pytest.raises(ConfigError, match="loss.norm_length"):
        build_config({"loss": {"mode": "seq-mean-token-sum-norm"}})
    with pytest.raises(ConfigError, match="model.path"):
        build_config({"model": {"kind": "gguf"}})


def test_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: {lr: 0.01}\ntrainer: {steps: 7}\n")
    cfg = load_config(path, ["optim.lr=1e-3", "rollout.n_per_task=4"])
    assert (cfg.optim.lr, cfg.trainer.steps, cfg.rollout.n_per_task) == (1e-3, 7, 4)
    path.write_text("optim: {lr: 0.01, betas: [0.9, 0.99]}\n")
    with pytest.raises(ConfigError, match="'optim.betas'"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)
    path.write_text("optim: {lr: 0.01\n")  # a YAML syntax error: the file named, no traceback
    with pytest.raises(ConfigError, match="c.yaml': not YAML .*flow mapping"):
        load_config(path)


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["optim.lr"])
    with pytest.raises(ConfigError, match="section"):
        parse_overrides(["optim=1", "optim.lr=2"])


@given(st.integers(min_value=1, max_value=10**6), st.floats(min_value=1e-9, max_value=10.0))
def test_overrides_round_trip(steps, lr):
    cfg = build_config({}, [f"trainer.steps={steps}", f"optim.lr={lr!r}"])
    assert cfg.trainer.steps == steps and cfg.optim.lr == lr
    assert TrainConfig.model_validate(cfg.model_dump()) == cfg


def test_cli_train_names_the_bad_key(tmp_path):
    """`tracetrain train` reports a bad key in one line with status 2, before any work starts."""
    import subprocess
    import sys

    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer: {steps: 3}\n")
    proc = subprocess.run([sys.executable, "-m", "tracetrain", "train", str(cfg), "optim.lrr=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "config key 'optim.lrr': unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("roles, key, says", [
    ({"train": ["a b"]}, "roles.train", "'a b' is not a role name"),
    ({"train": ["x"], "serve": {"<b>": "frozen"}}, "roles.serve", "'<b>' is not a role name"),
    ({"train": ["x"], "serve": {"checker": ""}}, "roles.serve", "engine name is empty"),
    ({"serve": {"checker": "frozen"}}, "roles", "name the roles that train in roles.train"),
    ({"train": ["checker"], "serve": {"checker": "frozen"}}, "roles", "would not be the policy's"),
])
def test_bad_roles_are_refused_naming_the_key(roles, key, says):
    with pytest.raises(ConfigError, match=f"config key '{key}'") as e:
        build_config({"roles": roles})
    assert says in str(e.value)


def test_frozen_roles_need_the_local_engine_on_the_embedded_backend():
    ok = build_config({"roles": {"train": ["solver"], "serve": {"checker": "frozen", "judge": "policy"}}})
    assert ok.roles.serve == {"checker": "frozen", "judge": "policy"}
    with pytest.raises(ConfigError, match="for engine.kind local"):
        build_config({"roles": {"train": ["solver"], "serve": {"checker": "frozen"}},
                      "engine": {"kind": "vllm", "base_url": "http://127.0.0.1:9"}})


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "examples").glob("*/*.yaml")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_example_config_loads(path):
    """The configs the README and docs point at are valid as shipped (keys, values, combinations)."""
    from tracetrain.config import load_config

    cfg = load_config(path)
    assert cfg.task


# ------------------------------------------------- keys that moved, and the engine's keys by kind
@pytest.mark.parametrize("key, value, says", [
    ("trainer.overlap_collect", True, "replaced by trainer.collect: overlap (true) or step (false)"),
    ("trainer.overlap_collect", False, "replaced by trainer.collect: overlap (true) or step (false)"),
    ("trainer.threads", 2, "moved to engine.threads"),
    ("rollout.batch_window_ms", 5.0, "moved to engine.batch_window_ms"),
])
def test_a_moved_key_is_refused_naming_where_it_went(tmp_path, key, value, says):
    """In a file and as an override: an error naming the old key and the new one, not a key
    silently dropped or an unexplained 'unknown key'."""
    import yaml

    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({section: {name: value}}))
    for build in (lambda: load_config(path), lambda: build_config({}, [f"{key}={str(value).lower()}"])):
        with pytest.raises(ConfigError) as e:
            build()
        assert str(e.value).startswith(f"config key {key!r}: {says}")


def test_the_moved_keys_in_their_new_places():
    cfg = build_config({}, ["trainer.collect=overlap", "trainer.max_staleness=1", "engine.threads=2",
                            "engine.batch_window_ms=0"])
    assert (cfg.trainer.collect, cfg.engine.threads, cfg.engine.batch_window_ms) == ("overlap", 2, 0.0)
    vllm = build_config({"engine": {"kind": "vllm", "python": "p", "threads": 3}})
    assert vllm.engine.threads == 3 and not hasattr(vllm.engine, "batch_window_ms")
    assert TrainConfig.model_validate(vllm.model_dump()) == vllm


@pytest.mark.parametrize("engine, says", [
    ({"base_url": "http://127.0.0.1:9"},
     "config key 'engine.base_url': only for engine.kind 'vllm' (engine.kind is 'local')"),
    ({"kind": "local", "args": ["--x"]}, "config key 'engine.args': only for engine.kind 'vllm'"),
    ({"kind": "local", "sleep_level": 1}, "config key 'engine.sleep_level': only for engine.kind 'vllm'"),
    ({"kind": "vllm", "python": "p", "batch_window_ms": 1.0},
     "config key 'engine.batch_window_ms': only for engine.kind 'local' (engine.kind is 'vllm')"),
    ({"kind": "vllm", "python": "p", "sync": "ncl"}, "config key 'engine.sync': Input should be"),
    ({"kind": "vllm", "python": "p", "pyhton": "x"}, "config key 'engine.pyhton': unknown key"),
    ({"kind": "vllm"}, "config key 'engine.python': engine.kind 'vllm' needs either"),
    ({"kind": "vlm"}, "config key 'engine.kind': unknown engine kind 'vlm'; known: local, vllm"),
])
def test_each_engine_kind_takes_its_own_keys(engine, says):
    with pytest.raises(ConfigError) as e:
        build_config({"engine": engine})
    assert str(e.value).startswith(says)


def test_a_plugin_engine_kind_takes_the_keys_of_both_kinds():
    from tracetrain import registry

    registry.ENGINE_KINDS.names()  # the built-in kinds registered before they are saved
    saved = dict(registry.ENGINE_KINDS._entries)
    registry.ENGINE_KINDS.register("mine")(lambda *a, **k: None)
    try:
        cfg = build_config({"engine": {"kind": "mine", "threads": 2, "batch_window_ms": 0.0,
                                       "base_url": "http://127.0.0.1:9", "sync": "nccl"}})
        assert type(cfg.engine).__name__ == "PluginEngineConfig"
        assert (cfg.engine.kind, cfg.engine.threads, cfg.engine.sync) == ("mine", 2, "nccl")
        assert TrainConfig.model_validate(cfg.model_dump()) == cfg
    finally:
        registry.ENGINE_KINDS._entries.clear()
        registry.ENGINE_KINDS._entries.update(saved)


def test_a_dumped_config_takes_another_engine_kind_by_override():
    """A run's config.json holds every key, the local engine's defaults included: an override of
    engine.kind drops those the new kind does not take; one holding another value is refused."""
    dumped = build_config({"engine": {"threads": 2}}).model_dump(mode="json")
    cfg = build_config(dumped, ["engine.kind=vllm", "engine.python=p"])
    assert (cfg.engine.kind, cfg.engine.threads) == ("vllm", 2)
    dumped["engine"]["batch_window_ms"] = 5.0
    with pytest.raises(ConfigError, match=r"'engine\.batch_window_ms': only for engine\.kind 'local'"):
        build_config(dumped, ["engine.kind=vllm", "engine.python=p"])


# ----------------------------------------------------------------- the environment's keys by kind
@pytest.mark.parametrize("env, says", [
    ({"verifiers": {"env_id": "vf-sums", "args": {"n": 3}}},
     "config key 'env.kind': the environment's kind is a key of `env` now, beside its other keys: "
     "write `env: {kind: verifiers, env_id: vf-sums, args: {n: 3}}`"),
    ({"env_id": "vf-sums"},
     "config key 'env.kind': required, one of reasoning_gym, verifiers, environment_class, openenv"),
    ({"kind": "verifiers", "env_id": "x", "dataset": "y"},
     "config key 'env.dataset': only for env.kind 'reasoning_gym' (env.kind is 'verifiers')"),
    ({"kind": "reasoning_gym", "size": 10}, "config key 'env.dataset': give `dataset` (one)"),
    ({"kind": "openenv", "client": "a:B"}, "config key 'env.app': give `app`"),
])
def test_each_env_kind_takes_its_own_keys(env, says):
    with pytest.raises(ConfigError) as e:
        build_config({"env": env})
    assert str(e.value).startswith(says)


def test_the_env_kind_chooses_its_section_and_the_old_shape_is_told_the_new_one():
    cfg = build_config({"env": {"kind": "verifiers", "env_id": "vf-sums"}})
    assert type(cfg.env).__name__ == "VerifiersConfig" and cfg.env.env_id == "vf-sums"
    assert TrainConfig.model_validate(cfg.model_dump()) == cfg
    assert build_config({}, ["env.kind=verifiers", "env.env_id=vf-sums"]) == cfg
    with pytest.raises(ConfigError, match=r"write `env: \{kind: verifiers, env_id: vf-sums\}`"):
        build_config({}, ["env.verifiers.env_id=vf-sums"])
