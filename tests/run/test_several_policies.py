"""Several policies in one run (config `policies`, run/policies.py): a LoRA adapter per policy on one
base, each call decoded by its role's adapter, each policy updated from its own roles' tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.config import ConfigError, build_config
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.models import lora
from tracetrain.models.load import load_policy
from tracetrain.objective.credit import batch_credit
from tracetrain.rows.aggregate import aggregate
from tracetrain.run import checkpoint, durable
from tracetrain.run.trainer import Trainer, train
from tracetrain.store import SQLiteStore
from tracetrain.types import Rollout, RolloutState, Turn

SUPPORT = Path(__file__).resolve().parents[1] / "support"
TIMES = ("time/", "rollouts_per_s", "trained_tokens_per_s", "memory/", "engine/idle_frac")
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1"]
POLICIES = {"solver": {"roles": ["solver"], "lora": {"r": 4, "alpha": 8}},
            "checker": {"roles": ["checker"], "lora": {"r": 2, "alpha": 4}, "lr": 3e-2}}


def config(run: Path, *extra: str, policies=POLICIES, task="two_roles_task.py"):
    return build_config({"policies": policies} if policies is not None else {}, [
        f"task={task}", *TINY, "rollout.tasks_per_step=2", "rollout.n_per_task=3",
        "rollout.max_tokens=5", "optim.lr=2e-2", "optim.warmup_steps=0", "trainer.eval_every=0",
        "trainer.steps=3", "trainer.seed=3", "trainer.checkpoint_minutes=0",
        "advantage.estimator=return-to-go", "rollout.agent_workers=0",
        f"trainer.run_dir={run}", *extra])


def run(cfg) -> list[dict]:
    train(cfg, base_dir=SUPPORT, log=lambda *_: None)
    return [json.loads(x) for x in (Path(cfg.trainer.run_dir) / "metrics.jsonl").read_text().splitlines()]


def without_times(ms: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(TIMES)} for m in ms]


def adapters(run_dir: Path) -> dict:
    return checkpoint.load(run_dir / "checkpoint.pt")["model"]


def initial(cfg) -> dict:
    """The weights the run starts from (the same seed: the same base and fresh adapters)."""
    return lora.weights(Trainer(cfg, None).learner.model)


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("policies, extra, key", [
    ({"solver": {"roles": ["solver"]}}, ["roles.train=[solver,judge]"], "roles.train"),
    ({"a1": {"roles": ["x"]}, "b1": {"roles": ["x"]}}, [], "policies.b1.roles"),
    ({"solver": {"roles": ["solver"]}}, ["model.lora.r=4"], "model.lora"),
    ({"solver": {"roles": ["solver"]}}, ["engine.kind=vllm", "engine.base_url=http://127.0.0.1:1"],
     "policies"),
    # (local)
    ({"solver": {"roles": ["solver"]}}, ["trainer.collect=overlap", "trainer.max_staleness=1"], "policies"),
    ({"solver": {"roles": ["solver"]}}, ["backend=verl"], "policies"),
    ({"ra": {"roles": ["solver"]}}, [], "policies.ra"),  # (part of "lora_": peft's prefix)
    ({"__base__": {"roles": ["solver"]}}, [], "policies.__base__"),
    ({"a.b": {"roles": ["solver"]}}, [], "policies.a.b"),
    ({"solver": {"roles": []}}, [], "policies.solver.roles"),
    ({"solver": {"roles": ["solver"]}}, ["roles.serve={solver: frozen}", "roles.train=[solver]"], "roles"),
])
def test_a_config_that_cannot_mean_one_thing_is_refused_naming_the_key(tmp_path, policies, extra, key):
    with pytest.raises(ConfigError, match=rf"config key '{key}'"):
        config(tmp_path, *extra, policies=policies)


def test_an_adapter_on_layers_the_model_lacks_is_refused_naming_the_policy(tmp_path):
    cfg = config(tmp_path, policies={"solver": {"roles": ["solver"], "lora": {"target_modules": ["nope"]}}})
    with pytest.raises(ConfigError, match=r"config key 'policies.solver.lora.target_modules'"):
        Trainer(cfg, None)


# -- serving -----------------------------------------------------------------------------------
def test_one_batch_of_several_adapters_decodes_each_row_by_its_own(tmp_path):
    """Rows of two adapters and the base in one batch: each request's tokens and logprobs are
    those of its adapter decoding alone (the same seeds), within float noise of a batch's shape."""
    cfg = config(tmp_path)
    model, tok = load_policy(cfg.model, seed=0)
    model = lora.wrap_policies(model, {n: p.lora for n, p in cfg.policies.items()})
    with torch.no_grad():  # adapters that differ from the base and from each other
        g = torch.Generator().manual_seed(1)
        for name in ("solver", "checker"):
            for p in lora.policy_parameters(model, name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    engine = LocalEngine(model, tok, max_context=64, prefix_cache=False)
    prompt = [5, 9, 13, 2, 7, 11, 3]
    who = ["solver", "checker", lora.BASE, "solver", "checker", lora.BASE]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=40 + k, adapter=a)
              for k, a in enumerate(who)]
    mixed = engine.generate_batch([prompt] * len(who), params)
    alone = [engine.generate_batch([prompt], [p])[0] for p in params]
    for m, a in zip(mixed, alone, strict=True):
        assert m.response_ids == a.response_ids
        assert max(abs(x - y) for x, y in zip(m.response_logprobs, a.response_logprobs, strict=True)) < 1e-4
    # the adapters make a difference: the same seed, other tokens or other logprobs
    assert mixed[0].response_logprobs != mixed[1].response_logprobs != mixed[2].response_logprobs
    # a request naming an adapter the model has not: refused by name
    with pytest.raises(ValueError, match="adapter 'judge'"):
        engine.generate_batch([prompt], [SamplingParams(max_tokens=2, adapter="judge")])


# -- training ----------------------------------------------------------------------------------
def test_each_adapter_moves_with_its_own_roles_tokens_only(tmp_path):
    """Two policies, the checker's role not trained (roles.train: [solver]): after 3 steps the
    solver's adapter moved, the checker's adapter and the base are bit for bit as they started;
    the engine decoded each role with its adapter (logprob gap of float noise); every rollout
    weighs 1/R_p in its policy's loss."""
    cfg = config(tmp_path / "run", "roles.train=[solver]")
    start = initial(cfg)
    ms = run(cfg)
    end = adapters(tmp_path / "run")
    assert any(not torch.equal(start["solver"][k], end["solver"][k]) for k in start["solver"])
    assert all(torch.equal(start["checker"][k], end["checker"][k]) for k in start["checker"])
    assert all("policy/checker/loss" not in m for m in ms) and all("policy/solver/loss" in m for m in ms)
    for m in ms:
        assert m["policy/solver/loss/rollout_mass_x_R_min"] == pytest.approx(1.0, abs=1e-6)
        assert m["policy/solver/loss/rollout_mass_x_R_max"] == pytest.approx(1.0, abs=1e-6)
        assert m["policy/solver/engine/logprob_gap_max"] < 1e-4
    # policy/<name>/ exports: the merged model of each and its adapter alone
    for name in ("solver", "checker"):
        assert (tmp_path / "run" / "policy" / name / "config.json").is_file()
        assert (tmp_path / "run" / "policy" / name / "adapter" / "adapter_config.json").is_file()


def test_two_policies_learn_each_from_its_rows_and_weigh_one_per_rollout(tmp_path):
    """Both roles trained: both adapters move; each policy's rows are its role's only, and each
    policy's rollouts have mass 1/R_p (rollout_mass_x_R = 1); the engine's logprobs are the
    trainer's under each turn's own adapter (after the first update the adapters differ)."""
    cfg = config(tmp_path / "run")
    start = initial(cfg)
    ms = run(cfg)
    end = adapters(tmp_path / "run")
    for name in ("solver", "checker"):
        assert any(not torch.equal(start[name][k], end[name][k]) for k in start[name])
    for m in ms:
        for name in ("solver", "checker"):
            assert m[f"policy/{name}/loss/rollout_mass_x_R_min"] == pytest.approx(1.0, abs=1e-6)
            assert m[f"policy/{name}/loss/rollout_mass_x_R_max"] == pytest.approx(1.0, abs=1e-6)
            assert m[f"policy/{name}/engine/logprob_gap_max"] < 1e-4
        # the solver makes 2 calls per rollout, the checker 2: each policy's trained tokens are
        # its role's response tokens
        assert m["policy/solver/aggregate/tokens/trained"] == m["roles/solver/response_tokens"]
        assert m["policy/checker/aggregate/tokens/trained"] == m["roles/checker/response_tokens"]
        assert m["policy/checker/lr"] == pytest.approx(3e-2) and m["policy/solver/lr"] == pytest.approx(2e-2)
        # a group's calls share their prompts: the engine's prefix cache serves part of them
        assert 0 < m["engine/prefix_hit_rate"] < 1
        # the step's sampled entropy is the policies' weighted by their trained tokens
        tokens = {p: m[f"policy/{p}/aggregate/tokens/trained"] for p in ("solver", "checker")}
        assert m["entropy/sampled"] * m["aggregate/tokens/trained"] == pytest.approx(
            sum(m[f"policy/{p}/entropy/sampled"] * n for p, n in tokens.items()), rel=1e-9)
    # each policy's sampled entropy: the mean -logprob the engine recorded for its role's tokens
    with SQLiteStore(tmp_path / "run" / "traces.db", read_only=True) as store:
        rollouts = [r for r in store.load_rollouts() if "-s0-" in r.rollout_id]
    for name in ("solver", "checker"):
        lps = [x for r in rollouts for t in r.turns if t.role == name for x in t.response_logprobs]
        assert ms[0][f"policy/{name}/entropy/sampled"] == pytest.approx(-sum(lps) / len(lps), rel=1e-6)


def test_one_policy_holding_every_role_is_the_run_with_model_lora(tmp_path):
    """Reduction: `policies` with one policy of every trained role equals the single-policy run
    whose model.lora is that adapter: the same metrics step by step and the same adapter, bit for bit."""
    one = {"p": {"roles": ["solver", "checker"], "lora": {"r": 4, "alpha": 8}}}
    a = run(config(tmp_path / "a", policies=one))
    b = run(config(tmp_path / "b", "model.lora.r=4", "model.lora.alpha=8", policies=None))
    a = [{k: v for k, v in m.items() if not k.startswith("policy/")} for m in without_times(a)]
    assert a == without_times(b)
    wa, wb = adapters(tmp_path / "a")["p"], adapters(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_resumed_two_policy_run_is_the_uninterrupted_one(tmp_path):
    """Checkpoints hold every adapter, optimizer and schedule: a run resumed from step 1's
    checkpoint ends as the straight run does (metrics but the times, adapters bit for bit)."""
    straight = run(config(tmp_path / "a"))
    cut = tmp_path / "b"
    run(config(cut, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=5"))
    for later in (cut / "checkpoints").glob("step-00000[23].pt*"):
        later.unlink()
    resumed = run(config(cut, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=5",
                         "trainer.resume=true"))
    assert durable.newest_valid(cut)[0].name == "step-000003.pt"
    assert without_times(resumed) == without_times(straight)
    wa, wb = adapters(tmp_path / "a"), adapters(cut)
    assert all(torch.equal(wa[p][k], wb[p][k]) for p in wa for k in wa[p])


def test_the_viewer_shows_each_turns_policy_and_explains_each_policys_rows(tmp_path):
    """`tracetrain view` of a two-policy run: each turn's policy beside its role; a rollout's
    trained tokens, as policy p learned from it, are p's role's turns only; an unknown policy is
    a 400 naming it."""
    import re

    from fastapi.testclient import TestClient

    from tracetrain.store import SQLiteStore
    from tracetrain.view.app import create_view_app

    run(config(tmp_path / "run"))
    store = SQLiteStore(tmp_path / "run" / "traces.db")
    rec = next(r for r in store.list_rollouts(state="succeeded", limit=100) if "-s2-" in r.group_id)
    roles = {t.index: t.role for t in store.get_turns(rec.rollout_id)}
    store.close()
    with TestClient(create_view_app(tmp_path / "run")) as c:
        page = c.get(f"/rollout/{rec.rollout_id}").text
        shown = re.findall(r"<tr><td>(\d+)</td><td>(\w+)</td><td class=\"policy\">(\w+)</td>", page)
        assert {(int(k), role) for k, role, _ in shown} == set(roles.items())
        assert all(role == policy for _, role, policy in shown)  # (each role is its own policy here)
        for policy in ("solver", "checker"):
            page = c.get(f"/rollout/{rec.rollout_id}", params={"policy": policy}).text
            turns = {int(x) for x in re.findall(r'class="tok trained[^"]*"[^>]*data-turn="(\d+)"', page)}
            assert turns and {roles[k] for k in turns} == {policy}
        bad = c.get(f"/rollout/{rec.rollout_id}", params={"policy": "judge"})
        assert bad.status_code == 400
        assert "policy &#39;judge&#39;: this run&#39;s policies are solver, checker" in bad.text
        step = c.get("/step/2", params={"policy": "checker"})
        assert step.status_code == 200 and "<b>checker</b>" in step.text


def test_sft_and_eval_take_every_policy(tmp_path, capsys):
    """`tracetrain sft` with a two-policy config fine-tunes each adapter on its own roles' tokens
    (policy/<p>/ each, the weights-only checkpoint every adapter); `tracetrain eval --policy` of
    that checkpoint serves each role by its policy's adapter (no failed try)."""
    import yaml

    from tracetrain.cli import main

    run(config(tmp_path / "run", "trainer.steps=1"))
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "task": str(SUPPORT / "two_roles_task.py"), "policies": POLICIES,
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1},
        "rollout": {"max_tokens": 5, "agent_workers": 0}, "trainer": {"seed": 3}}))
    start = initial(build_config(yaml.safe_load(cfg_file.read_text()), [f"trainer.run_dir={tmp_path / 'x'}"]))
    assert main(["sft", str(cfg_file), "--from", str(tmp_path / "run"), "--min-reward", "0",
                 "--epochs", "1", "--lr", "1e-2", "--out", str(tmp_path / "sft")]) == 0
    report = json.loads((tmp_path / "sft" / "sft.json").read_text())
    assert sorted(report["epoch_losses"]) == ["checker", "solver"]
    tuned = torch.load(tmp_path / "sft" / "checkpoint.pt", weights_only=False)["model"]
    for name in ("solver", "checker"):
        assert any(not torch.equal(start[name][k], tuned[name][k]) for k in start[name])
        assert (tmp_path / "sft" / "policy" / name / "adapter" / "adapter_config.json").is_file()
    capsys.readouterr()
    assert main(["eval", str(cfg_file), "--policy", str(tmp_path / "sft" / "checkpoint.pt"),
                 "--k", "1", "--tasks", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["failed"] == 0 and summary["tries"] == 2


def test_continuous_collection_trains_every_policy_each_group_once(tmp_path):
    """trainer.collect continuous with two policies: every step's groups are trained by both
    policies, each rollout weighing 1/R_p in each, within the staleness bound; no group twice."""
    ms = run(config(tmp_path / "run", "trainer.collect=continuous", "trainer.max_staleness=0",
                    "trainer.steps=4"))
    assert [m["step"] for m in ms] == [0, 1, 2, 3]
    groups = [g for m in ms for g in m["collect/groups"]]
    assert len(groups) == len(set(groups)) == 4 * 2
    for m in ms:
        for p in ("solver", "checker"):
            assert m[f"policy/{p}/loss/rollout_mass_x_R_min"] == pytest.approx(1.0, abs=1e-6)
            assert m[f"policy/{p}/loss/rollout_mass_x_R_max"] == pytest.approx(1.0, abs=1e-6)
        assert set(k for k in m if k.startswith("staleness/rollouts_")) == {"staleness/rollouts_0"}


# -- isolation, as properties (hypothesis) -----------------------------------------------------
@st.composite
def two_role_rollouts(draw):
    """Rollouts of two groups whose calls are role p's or q's, interleaved; each role's calls
    continue its own context (its prompt = its previous prompt + response + new tokens); rewards
    per rollout, turn rewards on some turns."""
    tokens = st.integers(0, 40)
    out = []
    for i in range(draw(st.integers(2, 6))):
        context = {"p": draw(st.lists(tokens, min_size=1, max_size=5)),
                   "q": draw(st.lists(tokens, min_size=1, max_size=5))}
        turns = []
        for role in draw(st.lists(st.sampled_from("pq"), min_size=1, max_size=6)):
            resp = draw(st.lists(tokens, min_size=1, max_size=4))
            turns.append(Turn(list(context[role]), resp, [-0.5] * len(resp), 0, role=role,
                              reward=draw(st.one_of(st.none(), st.floats(-1, 1)))))
            context[role] = context[role] + resp + draw(st.lists(tokens, min_size=1, max_size=3))
        out.append(Rollout(f"r{i}", f"g{i % 2}", turns, draw(st.floats(-1, 1)), RolloutState.succeeded))
    return out


def p_rows(rollouts, estimator: str):
    """Policy p's rows, R_p and advantages as build_rows makes them under TrainConfig.for_policy."""
    cfg = build_config({"policies": {"p": {"roles": ["p"]}, "q1": {"roles": ["q"]}}},
                       ["task=x.py", f"advantage.estimator={estimator}"]).for_policy("p")
    batch, _ = aggregate(rollouts, level="trajectory", max_prompt_length=512, max_response_length=512,
                         pad_token_id=0, train_roles=cfg.roles.train)
    kept, adv, _ = batch_credit(batch, rollouts, estimator=estimator, train_roles=cfg.roles.train,
                                gamma=cfg.advantage.gamma, others=cfg.other_policies_roles)
    return kept, adv


@settings(max_examples=60, deadline=None)
@given(rollouts=two_role_rollouts(), estimator=st.sampled_from(["grpo", "return-to-go", "gigpo"]),
       data=st.data())
def test_another_policys_calls_change_none_of_ps_rows_rollouts_or_advantages(rollouts, estimator, data):
    """Removing policy q's calls, or moving them among p's, leaves p's rows (ids, masks, their
    rollouts), R_p and p's advantages bit for bit (docs/invariants.md 12)."""
    import random

    base, adv = p_rows(rollouts, estimator)
    seed = data.draw(st.integers(0, 1000))
    without_q = [Rollout(r.rollout_id, r.group_id, [t for t in r.turns if t.role == "p"], r.reward, r.state)
                 for r in rollouts]
    moved = []
    for r in rollouts:  # q's calls at other places among p's (each role's own order kept)
        ps, qs = [t for t in r.turns if t.role == "p"], [t for t in r.turns if t.role == "q"]
        slots = sorted(random.Random(seed).choices(range(len(ps) + 1), k=len(qs)))
        turns, k = [], 0
        for j, t in enumerate(ps + [None]):
            while k < len(qs) and slots[k] == j:
                turns.append(qs[k])
                k += 1
            if t is not None:
                turns.append(t)
        moved.append(Rollout(r.rollout_id, r.group_id, turns, r.reward, r.state))
    for other in (without_q, moved):
        got, got_adv = p_rows(other, estimator)
        assert got.rollouts == base.rollouts  # the rollouts holding p's tokens: R_p
        for field in ("input_ids", "attention_mask", "response_mask", "rollout_index"):
            assert torch.equal(getattr(got, field), getattr(base, field)), field
        assert (got_adv is None) == (adv is None)
        if adv is not None:
            assert torch.equal(got_adv, adv)
