"""The teacher in a run (config `distill`, run/teacher.py): a teacher with another tokenizer is
refused before any work, naming both; its scores go to the store once per rollout and teacher; a
run with a teacher resumed mid-run is the run without the stop; a teacher equal to the policy
teaches nothing; several policies each learn from their own teacher, or none."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from test_train_e2e import EXAMPLE, read_metrics, small_config

from tracetrain.config import ConfigError, build_config
from tracetrain.models.save import write_hf_dir
from tracetrain.models.tiny import build_model, build_tokenizer
from tracetrain.run import teacher
from tracetrain.run.trainer import train
from tracetrain.store import SQLiteStore

SUPPORT = Path(__file__).resolve().parents[1] / "support"
MEASURED = ("time/", "memory/", "rollouts_per_s", "trained_tokens_per_s", "engine/idle_frac")
# A teacher of the demo's tokenizer, not the policy (other sizes, the same seed).
TEACHER = json.dumps({"teacher": {"kind": "tiny", "hidden_size": 48, "num_layers": 2,
                                  "num_heads": 2, "num_kv_heads": 1}, "with_reward": True})
TOL = 64 * 1.2e-7 * 10 * 3  # tests/engines/test_score.py


def without_measured(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(MEASURED)} for m in rows]


def other_tokenizer_dir(tmp_path: Path) -> Path:
    """A tiny model whose tokenizer has one token more than the policy's."""
    tok = build_tokenizer()
    tok.add_tokens(["<teacher-only>"])
    model = build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=0)
    return write_hf_dir(model, tok, tmp_path / "teacher")


def test_a_teacher_with_another_tokenizer_refuses_the_run_before_any_work(tmp_path):
    path = other_tokenizer_dir(tmp_path)
    run = tmp_path / "run"
    cfg = small_config(run, 2, distill=json.dumps({"teacher": {"kind": "pretrained",
                                                               "path": str(path)}}))
    with pytest.raises(ConfigError, match=r"config key 'distill.teacher': its tokenizer "
                       r"\(.*teacher\) is not the policy's \(.*config key 'model'\): "
                       r"vocabularies of \d+ and \d+ tokens differ"):
        train(cfg, base_dir=EXAMPLE, log=lambda *_: None)
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoint.pt").exists()


@pytest.mark.parametrize("data, match", [
    ({"distill": {"teacher": {"kind": "tiny"}, "roles": ["checker"]}, "roles": {"train": ["solver"]}},
     r"config key 'distill.roles': \['checker'\] do not train here"),
    ({"distill": {"teacher": {"kind": "tiny"}}, "backend": "verl",
      "model": {"kind": "pretrained", "path": "x"}}, "config key 'distill': for backend 'embedded'"),
    ({"distill": {"teacher": {"kind": "tiny"}}, "policies": {"solver": {"roles": ["solver"]}}},
     "config key 'distill': with policies each policy names its own teacher"),
    ({"distill": {"teacher": {"url": "ftp://x", "name": "t"}}}, "config key 'distill.teacher.url'"),
    ({"distill": {"teacher": {"kind": "tiny"}, "coef": 0}}, "config key 'distill.coef'"),
])
def test_a_bad_distill_section_is_an_error_naming_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        build_config(data)


def test_the_teacher_scores_each_rollout_once_and_a_resumed_run_is_the_run_without_the_stop(
        tmp_path):
    """Two steps, then two more resumed: the same metrics (the teacher's among them) and weights
    as four straight; and teaching a step again scores nothing (its events are read back)."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    train(small_config(run, 2, distill=TEACHER), base_dir=EXAMPLE, log=lambda *_: None)
    train(small_config(run, 4, distill=TEACHER, **{"trainer.resume": "true"}), base_dir=EXAMPLE,
          log=lambda *_: None)
    train(small_config(straight, 4, distill=TEACHER), base_dir=EXAMPLE, log=lambda *_: None)
    a, b = read_metrics(run), read_metrics(straight)
    assert without_measured(a) == without_measured(b)
    assert all(m["distill/taught_tokens"] > 0 and m["teacher/scored_tokens"] > 0 for m in b)
    # another model: it teaches (a sampled estimate of the KL, of either sign on a step)
    assert max(abs(m["distill/reverse_kl"]) for m in b) > 20 * TOL
    wa, wb = (torch.load(r / "checkpoint.pt", weights_only=False)["model"] for r in (run, straight))
    assert all(torch.equal(wa[k], wb[k]) for k in wb)

    store = SQLiteStore(run / "traces.db")
    try:
        trained = [r for r in store.list_rollouts(limit=1000) if "-s0-" in r.group_id]
        events = [store.list_events(r.rollout_id, "teacher") for r in trained]
        assert trained and all(len(e) == 1 for e in events)
        rollouts = store.load_rollouts(rollout_ids=[r.rollout_id for r in trained])
        for r, (event,) in zip(rollouts, events, strict=True):
            turns = event.payload["turns"]
            assert sorted(map(int, turns)) == [k for k, t in enumerate(r.turns) if t.response_ids]
            assert all(len(turns[str(k)]) == len(r.turns[k].response_ids) for k in map(int, turns))
        cfg = small_config(run, 4, distill=TEACHER)

        async def again():
            teachers = await teacher.load_teachers(cfg, build_tokenizer(), 1)
            try:
                return await teacher.teach(teachers, store, trained, cfg)
            finally:
                await teacher.close(teachers)

        assert asyncio.run(again())["teacher/scored_tokens"] == 0
    finally:
        store.close()


def test_a_teacher_equal_to_the_policy_teaches_nothing(tmp_path):
    """No warm start: the teacher is the policy's own model (same sizes, same seed); its term
    is 0 on every sampled token, to the scoring tolerance."""
    run = tmp_path / "run"
    same = json.dumps({"teacher": {"kind": "tiny", "hidden_size": 32, "num_layers": 2,
                                   "num_heads": 2, "num_kv_heads": 1}})
    train(small_config(run, 1, distill=same, **{"warm_start.steps": 0}), base_dir=EXAMPLE,
          log=lambda *_: None)
    (m,) = read_metrics(run)
    assert m["distill/taught_tokens"] > 0 and abs(m["distill/reverse_kl"]) < TOL
    store = SQLiteStore(run / "traces.db")
    try:
        ids = [r.rollout_id for r in store.list_rollouts(limit=1000) if "-s0-" in r.group_id]
        scores = teacher.teacher_scores(store, ids)
        worst = max(abs(s - lp) for r in store.load_rollouts(rollout_ids=ids)
                    for k, t in enumerate(r.turns)
                    for s, lp in zip(scores[r.rollout_id][k], t.response_logprobs, strict=True))
        assert worst < TOL
    finally:
        store.close()


def test_several_policies_each_learn_from_their_own_teacher_or_none(tmp_path):
    """The solver's policy has a teacher, the checker's none: only the solver's turns are scored,
    only its rows carry the term."""
    from test_several_policies import POLICIES, config

    policies = {"solver": {**POLICIES["solver"], "distill": {"teacher": {
        "kind": "tiny", "hidden_size": 48, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}}},
        "checker": POLICIES["checker"]}
    run = tmp_path / "run"
    train(config(run, "trainer.steps=1", policies=policies), base_dir=SUPPORT, log=lambda *_: None)
    (m,) = read_metrics(run)
    assert m["policy/solver/distill/taught_tokens"] > 0
    assert not any(k.startswith("policy/checker/distill/") for k in m)
    store = SQLiteStore(run / "traces.db")
    try:
        ids = [r.rollout_id for r in store.list_rollouts(limit=1000)]
        scores = teacher.teacher_scores(store, ids)
        roles = {r.turns[k].role for r in store.load_rollouts(rollout_ids=ids)
                 for k in scores[r.rollout_id]}
        assert roles == {"solver"}
    finally:
        store.close()


@pytest.mark.parametrize("collect", ["continuous", "overlap"])
def test_the_teacher_scores_what_each_collection_mode_trains(tmp_path, collect):
    """Collected ahead of the update (overlap) or group by group (continuous): every trained
    token of every step is taught, the scores read from the store."""
    run = tmp_path / "run"
    train(small_config(run, 3, distill=TEACHER, **{"trainer.collect": collect,
                                                  "trainer.max_staleness": 1}),
          base_dir=EXAMPLE, log=lambda *_: None)
    rows = read_metrics(run)
    assert len(rows) == 3
    for m in rows:
        roles = [k.split("/")[1] for k, v in m.items() if k.startswith("roles/")
                 and k.endswith("/trained") and v]
        trained = sum(m[f"roles/{role}/response_tokens"] for role in roles)
        assert m["distill/taught_tokens"] == trained > 0
