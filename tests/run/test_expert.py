"""The warm start from an expert (run/expert.py, engines/expert.py): the expert plays through the
gateway in the policy's own tokens (exact across turns, for a template that renders tools and for
SmolLM2's, which drops them), a model behind an OpenAI-compatible URL is an expert, a TRL
conversational file is one too, and `tracetrain train` warm-starts from a scripted expert, then
runs RL, with the expert's rollouts kept apart from the policy's."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from chat_templates import HERMES_TOOLS, with_template
from gateway_fixtures import CALC_TOOLS, ScriptedEngine, hermes_call, live_gateway, tiny_tokenizer
from openai import OpenAI

from tracetrain.config import ConfigError, load_config
from tracetrain.engines.expert import ExpertEngine, chat_expert
from tracetrain.models.tool_prompt import TOOL_BLOCK, chat_text
from tracetrain.rows.aggregate import aggregate
from tracetrain.run.expert import file_rollouts

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "environment_class"


def tokenizer(name: str):
    if name == "smollm2":
        import real_tokenizers

        return real_tokenizers.smollm2()
    return with_template(tiny_tokenizer(), HERMES_TOOLS)


def calc_expert(messages, tools):
    """Calls calc on the question, then answers with the tool's result."""
    if messages[-1]["role"] == "tool":
        return f"It is {messages[-1]['content']}."
    return {"content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": '{"expr": "6*7"}'}}]}


async def async_expert(messages, tools):
    return calc_expert(messages, tools)


def converse(gw) -> tuple[str, list]:
    """A harness's tool loop through the gateway: ask, run each call, send the results back."""
    (r,) = gw.create(1)
    client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "What is 6*7? Use the tool."}]
    answers = []
    for _ in range(3):
        out = client.chat.completions.create(model="policy", messages=messages, tools=CALC_TOOLS)
        message = out.choices[0].message
        answers.append(message)
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for tc in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": "42"})
    return r["rollout_id"], answers, messages


@pytest.mark.parametrize("tok_name, inject", [("tiny", False), ("smollm2", True)])
@pytest.mark.parametrize("expert", [calc_expert, async_expert], ids=["sync", "async"])
def test_an_experts_rollout_is_exact_in_the_policys_tokens(tmp_path, tok_name, inject, expert):
    tok = tokenizer(tok_name)

    async def answer(messages, tools):
        reply = expert(messages, tools)
        return await reply if hasattr(reply, "__await__") else reply

    engine = ExpertEngine(tok, answer, max_context=8192, inject=inject)
    with live_gateway(tmp_path, engine) as gw:
        rid, answers, messages = converse(gw)
        turns = gw.store.get_turns(rid)
        gw.admin.patch(f"/rollouts/{rid}", json={"state": "succeeded"})
        rollouts = gw.store.load_rollouts(rollout_ids=[rid])
        gw.admin.close()
    (call,) = answers[0].tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calc", {"expr": "6*7"})
    assert answers[1].content == "It is 42." and not answers[1].tool_calls
    assert [t.context for t in turns] == ["rendered", "exact"]
    assert [t.model_version for t in turns] == [None, None]  # no version of the policy
    _, metrics, breaks = aggregate(rollouts, max_prompt_length=8192, max_response_length=8192,
                                   pad_token_id=0, tokenizer=tok, return_breaks=True)
    assert breaks == [] and metrics["n_rows"] == 1
    # the whole conversation, as the policy's template renders it, is the recorded ids
    whole = turns[1].prompt_ids + turns[1].response_ids
    text = chat_text(tok, messages, CALC_TOOLS, generation_prompt=False, inject=inject)
    assert tok.decode(whole, skip_special_tokens=False) == text.removesuffix("\n")
    block = TOOL_BLOCK.splitlines()[2]  # the gateway's block, not the template's own tools
    assert tok.decode(turns[0].prompt_ids).count(block) == (1 if inject else 0)


def test_a_model_behind_a_url_is_an_expert(tmp_path, monkeypatch):
    """chat_expert against a real OpenAI-compatible server (a gateway with a scripted model),
    its replies then played in the policy's tokens (SmolLM2's template, the tool block)."""
    import real_tokenizers

    teacher = ScriptedEngine(with_template(tiny_tokenizer(), HERMES_TOOLS))
    (tmp_path / "teacher").mkdir(), (tmp_path / "student").mkdir()
    with live_gateway(tmp_path / "teacher", teacher) as upstream:
        (t,) = upstream.create(1)
        monkeypatch.setenv("TT_TEST_EXPERT_KEY", t["api_key"])
        expert = chat_expert(t["base_url"], "teacher", api_key_env="TT_TEST_EXPERT_KEY")
        teacher.say(hermes_call("calc", {"expr": "6*7"}))
        teacher.say("It is 42.")
        engine = ExpertEngine(real_tokenizers.smollm2(), expert, max_context=8192, inject=True)
        with live_gateway(tmp_path / "student", engine) as gw:
            rid, answers, _ = converse(gw)
            turns = gw.store.get_turns(rid)
            gw.admin.close()
        asked = [teacher.tokenizer.decode(prompt) for prompt, _ in teacher.calls]
        upstream.admin.close()
    assert [a.tool_calls[0].function.name if a.tool_calls else a.content for a in answers] == [
        "calc", "It is 42."]
    assert len(asked) == 2 and len(turns) == 2
    # the teacher saw the conversation in its own template: the tool's result in its second prompt
    assert "42" not in asked[0].split("6*7")[-1] and asked[1].rstrip().endswith("assistant")
    assert '"expr": "6*7"' in asked[1] and "42" in asked[1].split("6*7")[-1]
    assert "<tool_call>" in engine.tokenizer.decode(turns[0].response_ids)


def test_a_trl_conversational_file_is_demonstrations_in_the_policys_tokens(tmp_path):
    import real_tokenizers

    tok = real_tokenizers.smollm2()
    conversation = [
        {"role": "user", "content": "What is 6*7?"},
        {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expr": "6*7"}}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "It is 42."},
    ]
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"messages": conversation, "tools": CALC_TOOLS}) + "\n"
                    + json.dumps({"messages": conversation[:1] + [
                        {"role": "assistant", "content": "42."}]}) + "\n")
    first, second = file_rollouts(path, tok, "auto")
    assert [len(r.turns) for r in (first, second)] == [2, 1] and first.reward == 1.0
    last = first.turns[-1]
    text = chat_text(tok, conversation, CALC_TOOLS, generation_prompt=False, inject=True)
    assert tok.decode(list(last.prompt_ids) + list(last.response_ids),
                      skip_special_tokens=False) == text.removesuffix("\n")
    assert tok.decode(first.turns[0].response_ids, skip_special_tokens=False) == (
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call><|im_end|>')
    assert "<tools>" not in tok.decode(second.turns[0].prompt_ids)  # no tools in that row


def test_the_expert_sections_are_checked(tmp_path):
    config = EXAMPLE / "config_tiny.yaml"
    with pytest.raises(ConfigError, match="warm_start.steps"):
        load_config(config, ["warm_start.steps=0",
                             "warm_start.expert={kind: scripted, path: expert.py:expert}"])
    with pytest.raises(ConfigError, match="warm_start.expert.path"):
        load_config(config, ["warm_start.steps=2", "warm_start.expert={kind: file, path: nope.jsonl}"])
    with pytest.raises(ConfigError, match="warm_start.expert.kind': 'teacher' is not one of scripted, "
                       "model, file"):
        load_config(config, ["warm_start.steps=2", "warm_start.expert={kind: teacher}"])
    with pytest.raises(ConfigError, match="warm_start.expert.model.url"):
        load_config(config, ["warm_start.steps=2",
                             "warm_start.expert={kind: model, model: {url: localhost, name: m}}"])


@pytest.mark.slow
@pytest.mark.parametrize("example", ["environment_class", "agents_sdk"])
def test_train_warm_starts_from_a_scripted_expert_then_runs_rl(tmp_path, example):
    """The example's expert (right on the questions whose hash is even) plays 8 rollouts through
    the gateway (the environment class's own loop; an OpenAI Agents SDK agent over the Responses
    API), then 3 supervised steps, then one RL step: its rollouts are in traces.db on engine
    'expert' with the rewards its rule gives, and none of them in the step."""
    import importlib.util

    from tracetrain.run.trainer import train

    run = tmp_path / "run"
    cfg = load_config(ROOT / "examples" / example / "config_tiny.yaml", [
        "warm_start.steps=3", "warm_start.batch_size=4", "warm_start.expert.rollouts=8",
        "trainer.steps=1", "trainer.eval_every=0", f"trainer.run_dir={run}"])
    train(cfg, base_dir=ROOT / "examples" / example, log=lambda *a, **k: None)

    spec = importlib.util.spec_from_file_location("example_expert", EXAMPLE / "expert.py")
    rule = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rule)
    db = sqlite3.connect(run / "traces.db")
    expert = db.execute("SELECT rollout_id, task, state, n_turns FROM rollouts "
                        "WHERE engine = 'expert' ORDER BY rollout_id").fetchall()
    policy = db.execute("SELECT COUNT(*) FROM rollouts WHERE engine IS NOT 'expert'").fetchone()[0]
    db.close()
    assert len(expert) == 8 and all(n == 2 and state == "succeeded" for _, _, state, n in expert)
    right = [0.0 if rule._off_by_one(json.loads(task)["question"]) else 1.0 for _, task, _, _ in expert]
    report = json.loads((run / "warm_start.json").read_text())
    assert report["warm_start/expert_rollouts"] == 8 and report["warm_start/expert_failed"] == 0
    assert report["warm_start/expert_reward_mean"] == pytest.approx(sum(right) / 8)
    assert 0 < sum(right) < 8  # the rule is right on some and wrong on others
    assert report["warm_start/steps"] == 3 and report["warm_start/demonstrations"] == 8
    (step,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert policy == cfg.rollout.tasks_per_step * cfg.rollout.n_per_task  # the step's own
    assert step["step"] == 0 and "warm_start/expert_reward_mean" not in step
