"""LoRA with the vllm engine against a real vLLM server (the CPU build, as in test_engine_vllm.py):
the server is launched on the base weights with LoRA enabled and each sync loads only the adapter.
After each sync vLLM's logprobs are the trainer's for base + adapter and its greedy answer is the
merged model's in transformers; a run trains through it, with and without collect overlap, and
changes only the adapter."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import test_engine_vllm
import torch
from safetensors.torch import load_file
from test_engine_vllm import (
    EXAMPLE,
    IN_PROCESS,
    IN_PROCESS_KEY,
    TOL,
    chat,
    greedy,
    metrics,
    teacher_forced,
    turn_versions_by_step,
    vllm_config,
)

from tracetrain.config import ConfigError, LoraConfig, build_config
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.upstream import UpstreamEngine
from tracetrain.engines.vllm import ADAPTER_NAME, LoraTransport, VLLMEngine
from tracetrain.engines.vllm_server import VLLMServer, server_command
from tracetrain.models import lora
from tracetrain.models.load import load_policy
from tracetrain.models.save import write_hf_dir
from tracetrain.models.tiny import build_model
from tracetrain.run.trainer import train

vllm_python = test_engine_vllm.vllm_python  # its fixtures: the vLLM interpreter, the tokenizer
tok = test_engine_vllm.tok
TARGETS = ["q_proj", "v_proj"]
LORA_KEYS = ["model.lora.r=8", f"model.lora.target_modules={json.dumps(TARGETS)}"]


def lora_policy(tok, r: int = 8):
    return lora.wrap(build_model(tok, seed=0), LoraConfig(r=r, alpha=2.0 * r, target_modules=TARGETS))


def set_adapter(pm, seed: int, scale: float = 0.3):
    """Random A and B (peft starts B at zero: base + adapter = base): an adapter that acts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return pm


# ----------------------------------------------------------------------------- no server needed
def test_lora_with_vllm_is_accepted_and_the_server_gets_the_lora_flags():
    cfg = build_config({}, ["engine.kind=vllm", "engine.python=/usr/bin/python3", *LORA_KEYS,
                            "trainer.collect=overlap", "trainer.max_staleness=1"])
    assert cfg.model.lora.r == 8 and cfg.engine.kind == "vllm" and cfg.trainer.collect == "overlap"
    transport = LoraTransport("/tmp/adapters", cfg.model.lora.r)
    cmd = " ".join(server_command("py", "/m", 9, max_model_len=512, dtype="float32",
                                  args=transport.server_args, cuda=False))
    assert "--enable-lora" in cmd and "--max-lora-rank 8" in cmd and "--max-loras 1" in cmd
    assert transport.env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    # vLLM takes a few ranks only: the smallest one that holds r
    assert [LoraTransport("/a", r).server_args[-1] for r in (1, 4, 16, 17, 300, 512)] == [
        "1", "8", "16", "32", "320", "512"]
    with pytest.raises(ConfigError, match="'model.lora.r'"):
        LoraTransport("/a", 513)
    with pytest.raises(ConfigError, match="'model.lora.r': at most 512"):
        build_config({}, ["engine.kind=vllm", "engine.python=/usr/bin/python3", "model.lora.r=513"])


@pytest.mark.parametrize("extra, key", [
    (["engine.kind=vllm", "engine.base_url=http://127.0.0.1:9"], "engine.base_url"),
    (["engine.kind=vllm", "engine.python=/usr/bin/python3", "engine.sync=nccl"], "engine.sync"),
    (["engine.kind=vllm", "engine.python=/usr/bin/python3", "engine.sleep_level=2"],
     "engine.sleep_level"),
    (["trainer.collect=overlap", "trainer.max_staleness=1"], "trainer.collect 'overlap'"),
])
def test_what_lora_does_not_run_with_is_an_error_naming_the_key(extra, key):
    with pytest.raises(ConfigError) as e:
        build_config({}, [*LORA_KEYS, *extra])
    assert "'model.lora'" in str(e.value) and key in str(e.value)


def test_a_sleeping_server_is_woken_before_the_adapter_is_loaded(tmp_path, tok):
    """Sleep level 1 (CUDA only, so up to the routes): woken, then the adapter alone is loaded
    (no weights reload), then the prefix cache is dropped; the requests name the adapter."""
    from fake_upstream import FakeUpstream

    pm = set_adapter(lora_policy(tok), 5)
    with FakeUpstream() as fake:
        async def go():
            engine = VLLMEngine(VLLMServer(None, fake.url), tok, tmp_path / "base", max_context=512,
                                transport=LoraTransport(tmp_path / "adapters", 8))
            try:
                await engine.sleep(1)
                await engine.load_weights(pm, 1)
                return engine.served_model, await engine.generate(chat(tok, "Guess."),
                                                                  SamplingParams(max_tokens=2))
            finally:
                await engine.aclose()

        model, gen = asyncio.run(go())
        calls = fake.app.state.weight_calls
    assert [r for r, _ in calls] == ["/sleep?level=1", "/wake_up", "/v1/load_lora_adapter",
                                     "/reset_prefix_cache"]
    path = tmp_path.resolve() / "adapters" / "v1"
    assert calls[2][1] == {"lora_name": ADAPTER_NAME, "lora_path": str(path)}
    assert model == ADAPTER_NAME and gen.model_version == 1
    saved = load_file(str(path / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)  # the adapter alone, as peft saves it
    assert json.loads((path / "adapter_config.json").read_text())["r"] == 8


# ----------------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def lora_served(tmp_path_factory, vllm_python, tok):
    """One server for the module on the tiny model's base weights, LoRA enabled (rank 8)."""
    pm = lora_policy(tok)
    root = tmp_path_factory.mktemp("lora-served")
    d = write_hf_dir(lora.base(pm), tok, root / "base")
    transport = LoraTransport(root / "adapters", 8)
    server = VLLMServer.launch(vllm_python, d, root / "vllm.log", args=transport.server_args,
                               env={**transport.env, **IN_PROCESS}, max_model_len=512, dtype="float32")
    try:
        yield server, pm, root
    finally:
        server.stop()


def synced_answers(lora_served, tok, adapters: list[int], prompts, params) -> list[tuple]:
    """One engine on the module's server: for each adapter seed, set the policy's adapter, sync
    it (version k + 1), answer every prompt at once (prompt k: params(k)). Per sync: the
    generations, a copy of the policy (base + adapter, peft) and the merged model."""
    server, pm, root = lora_served
    adapter_root = root / f"adapters-{'-'.join(map(str, adapters))}"

    async def go():
        engine = VLLMEngine(VLLMServer(None, server.base_url), tok, root / "base", max_context=512,
                            transport=LoraTransport(adapter_root, 8))
        out = []
        try:
            for version, seed in enumerate(adapters, 1):
                set_adapter(pm, seed)
                await engine.load_weights(pm, version)
                assert engine.served_model == ADAPTER_NAME and engine.model_version == version
                gens = await asyncio.gather(*(engine.generate(p, params(k)) for k, p in enumerate(prompts)))
                out.append((gens, copy.deepcopy(pm).eval(), lora.merged(pm).eval()))
            served = sorted(p.name for p in adapter_root.iterdir())
            assert served == [f"v{len(adapters)}"]  # older adapter directories removed
        finally:
            await UpstreamEngine.aclose(engine)
        return out

    return asyncio.run(go())


@pytest.mark.slow
def test_sampled_logprobs_after_each_adapter_sync_equal_the_trainers(lora_served, tok):
    """At temperature 0.7, after each of two syncs with different adapters, the logprob vLLM
    recorded for each sampled token is the trainer's teacher-forced one for base + adapter (and
    not the base's)."""
    _, pm, _ = lora_served
    prompts = [chat(tok, t) for t in ("Guess.", "Lower.", "What is 2 + 2?")]
    syncs = synced_answers(lora_served, tok, [1, 2], prompts, lambda k: SamplingParams(
        max_tokens=16, temperature=0.7, seed=k, stop_token_ids=()))
    base = lora.base(pm).eval()
    for version, (gens, policy, _) in enumerate(syncs, 1):
        for p, g in zip(prompts, gens, strict=True):
            assert g.model_version == version and len(g.response_ids) == len(g.response_logprobs) >= 1
            theirs = torch.tensor(g.response_logprobs)
            assert float((theirs - teacher_forced(policy, p, g.response_ids, 0.7)).abs().max()) < TOL
            assert float((theirs - teacher_forced(base, p, g.response_ids, 0.7)).abs().max()) > 10 * TOL
    lora_served[0].check_alive()


@pytest.mark.slow
def test_greedy_answers_after_each_adapter_sync_are_the_merged_models(lora_served, tok):
    _, pm, _ = lora_served
    prompts = [chat(tok, "Guess my number from 1 to 8."), chat(tok, "Higher.")]
    syncs = synced_answers(lora_served, tok, [3, 4], prompts, lambda k: SamplingParams(
        max_tokens=12, temperature=0.0, stop_token_ids=()))
    answers = [[g.response_ids for g in gens] for gens, _, _ in syncs]
    for got, (_, _, merged) in zip(answers, syncs, strict=True):
        assert got == [greedy(merged, p, 12) for p in prompts]
    base = lora.base(pm).eval()
    assert answers[0] != [greedy(base, p, 12) for p in prompts]  # the adapter acts
    assert answers[0] != answers[1]  # the second sync replaced the first adapter


def base_and_adapter_checks(run, cfg, loads: int) -> None:
    """Only the adapter trained: the checkpoint holds adapter weights alone, the base the server
    was launched on is the untrained one, and the merged policy differs from it only in the
    adapter's target layers; the server took `loads` adapters and never a full reload."""
    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["model"] and all("lora_" in k for k in ck["model"])
    assert any(float(v.abs().sum()) > 0 for k, v in ck["model"].items() if "lora_B" in k)
    initial, _ = load_policy(cfg.model, seed=cfg.trainer.seed)
    initial = {k: v for k, v in initial.state_dict().items()}
    served = load_file(str(run / "engine-weights" / "model.safetensors"))
    merged = load_file(str(run / "policy" / "model.safetensors"))
    assert served.keys() == merged.keys() == initial.keys() | {"lm_head.weight"}
    for k, v in served.items():
        torch.testing.assert_close(v, initial.get(k, initial["model.embed_tokens.weight"]), rtol=0, atol=0)
        target = any(f"{t}.weight" in k for t in TARGETS)
        assert torch.equal(merged[k], v) != target, k
    log = (run / "vllm.log").read_text()
    assert "reload_weights" not in log and "exited" not in log[-2000:].lower()
    assert log.count("Loaded new LoRA adapter") == loads


@pytest.mark.slow
def test_a_lora_run_through_vllm_trains_only_the_adapter_and_vllm_matches_the_trainer(tmp_path, vllm_python):
    run = tmp_path / "run"
    cfg = vllm_config(run, 2, [f"engine.python={vllm_python}", *LORA_KEYS, IN_PROCESS_KEY])
    train(cfg, base_dir=EXAMPLE, log=lambda *_: None)
    rows = metrics(run)
    assert [m["model_version"] for m in rows] == [1, 2]
    assert turn_versions_by_step(run) == {0: {0}, 1: {1}}
    for m in rows:  # after every sync vLLM's logprobs were the trainer's for base + adapter
        assert m["engine/logprob_gap_max"] < TOL and m["engine/requests"] > 0
        assert m["time/sync_s"] > 0 and m["n_failed"] == 0
    base_and_adapter_checks(run, cfg, loads=3)  # at the start and after each update
    assert sorted(p.name for p in (run / "engine-adapter").iterdir()) == ["v2"]
    assert json.loads((run / "policy" / "adapter" / "adapter_config.json").read_text())["r"] == 8


@pytest.mark.slow
def test_collect_overlap_with_lora_and_vllm_trains_one_version_old_and_resumes(tmp_path, vllm_python):
    """The server keeps its own adapter while the update runs; a checkpoint keeps the engine's
    adapter (not a second copy of the base) and a resumed run continues from it."""
    run = tmp_path / "run"
    overlap = [f"engine.python={vllm_python}", *LORA_KEYS, IN_PROCESS_KEY, "trainer.collect=overlap",
               "trainer.max_staleness=1"]
    cfg = vllm_config(run, 2, overlap)
    train(cfg, base_dir=EXAMPLE, log=lambda *_: None)
    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["engine"]["version"] == 1 and all("lora_" in k for k in ck["engine"]["model"])
    base_and_adapter_checks(run, cfg, loads=2)  # at the start and between the two collects
    train(vllm_config(run, 3, [*overlap, "trainer.resume=true"]), base_dir=EXAMPLE,
          log=lambda *_: None)
    rows = metrics(run)
    assert [m["rollout_model_version"] for m in rows] == [0, 0, 1]
    assert turn_versions_by_step(run) == {0: {0}, 1: {0}, 2: {1}}
    assert rows[0]["engine/logprob_gap_max"] < TOL  # on-policy: measured
    assert all(m["n_stale_rollouts"] == 0 and m["n_failed"] == 0 for m in rows)


def two_policy_config(run, vllm_python, *extra: str):
    policies = {"solver": {"roles": ["solver"], "lora": {"r": 8, "alpha": 16, "target_modules": TARGETS}},
                "checker": {"roles": ["checker"], "lora": {"r": 4, "alpha": 8, "target_modules": TARGETS}}}
    return build_config({"policies": policies}, [
        "task=two_roles_task.py", "rollout.tasks_per_step=2", "rollout.n_per_task=3",
        "rollout.max_tokens=5", "optim.lr=5e-2", "optim.warmup_steps=0", "trainer.steps=3",
        "trainer.eval_every=0", "rollout.agent_workers=0", f"trainer.run_dir={run}",
        "engine.kind=vllm", f"engine.python={vllm_python}", IN_PROCESS_KEY, *extra])


SUPPORT = test_engine_vllm.ROOT / "tests" / "support"


@pytest.mark.slow
def test_two_policies_through_vllm_decode_each_turn_by_its_own_adapter(tmp_path, vllm_python):
    """Several policies on a real vLLM server: each policy's adapter loaded under its name
    (--max-loras 2), each call served by its role's adapter in the server's mixed batches: after
    every sync, each policy's turns have the trainer's logprobs under that policy's adapter (and
    after the first update the two adapters and the base differ, so a turn decoded by another
    would show a gap)."""
    run = tmp_path / "run"
    train(two_policy_config(run, vllm_python), base_dir=SUPPORT, log=lambda *_: None)
    rows = metrics(run)
    assert [m["model_version"] for m in rows] == [1, 2, 3]
    for m in rows:
        for p in ("solver", "checker"):
            assert m[f"policy/{p}/engine/logprob_gap_max"] < TOL, (m["step"], p)
        assert m["n_failed"] == 0
    log = (run / "vllm.log").read_text()
    assert log.count("Loaded new LoRA adapter") == 2 * 4  # both, at the start and after each update
    served = {p.name for p in (run / "engine-adapter").iterdir()}
    assert served == {"solver", "checker"}
    # the adapters moved apart: the policies' final adapters differ from each other and from zero
    final = checkpoint_adapters(run)
    assert any(v.abs().max() > 0 for k, v in final["solver"].items() if "lora_B" in k)
    assert any(v.abs().max() > 0 for k, v in final["checker"].items() if "lora_B" in k)


def checkpoint_adapters(run) -> dict:
    from tracetrain.run import checkpoint

    return checkpoint.load(run / "checkpoint.pt")["model"]


@pytest.mark.slow
def test_two_policies_through_vllm_collect_continuously_within_the_staleness_bound(tmp_path, vllm_python):
    """Continuous collection with two policies on vLLM (the server takes both adapters between
    steps while groups are in flight): every group trained once by each policy, each rollout
    weighing 1/R_p, no rollout more than max_staleness versions old."""
    run = tmp_path / "run"
    train(two_policy_config(run, vllm_python, "trainer.collect=continuous", "trainer.max_staleness=1",
                            "trainer.steps=4"), base_dir=SUPPORT, log=lambda *_: None)
    rows = metrics(run)
    groups = [g for m in rows for g in m["collect/groups"]]
    assert len(rows) == 4 and len(groups) == len(set(groups)) == 8
    for m in rows:
        assert m["n_failed"] == 0
        assert set(k for k in m if k.startswith("staleness/rollouts_")) <= {
            "staleness/rollouts_0", "staleness/rollouts_1"}
        for p in ("solver", "checker"):
            assert m[f"policy/{p}/loss/rollout_mass_x_R_min"] == pytest.approx(1.0, abs=1e-6)
            assert m[f"policy/{p}/loss/rollout_mass_x_R_max"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow
def test_two_policies_through_vllm_with_collect_overlap_resume_from_the_engines_adapters(tmp_path,
                                                                                         vllm_python):
    """Collect overlap with two policies: the server keeps both adapters one version behind while
    the update runs; the checkpoint keeps the engine's adapters of both policies (not the base),
    and a resumed run continues from them."""
    run = tmp_path / "run"
    overlap = ["trainer.collect=overlap", "trainer.max_staleness=1"]
    train(two_policy_config(run, vllm_python, *overlap, "trainer.steps=2"), base_dir=SUPPORT,
          log=lambda *_: None)
    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["engine"]["version"] == 1 and sorted(ck["engine"]["model"]) == ["checker", "solver"]
    assert all("lora_" in k for p in ck["engine"]["model"].values() for k in p)
    train(two_policy_config(run, vllm_python, *overlap, "trainer.steps=3", "trainer.resume=true"),
          base_dir=SUPPORT, log=lambda *_: None)
    rows = metrics(run)
    assert [m["rollout_model_version"] for m in rows] == [0, 0, 1]
    for p in ("solver", "checker"):
        assert rows[0][f"policy/{p}/engine/logprob_gap_max"] < TOL  # on-policy: measured
        assert all(m[f"policy/{p}/loss/rollout_mass_x_R_min"] == pytest.approx(1.0, abs=1e-6) for m in rows)
    assert all(m["n_stale_rollouts"] == 0 and m["n_failed"] == 0 for m in rows)
