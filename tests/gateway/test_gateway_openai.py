"""The real `openai` SDK against a live gateway: multi-turn chat (streaming and not), completions,
tool calls; what the store recorded is exactly what the engine produced."""

from __future__ import annotations

import json

import openai
import pytest
from gateway_fixtures import FakeEngine, gateway, live_gateway  # noqa: F401

SYSTEM = {"role": "system", "content": "You are playing a game. Guess the secret number."}
USER = ["Guess a number between 1 and 100.", "Higher.", "Lower. Guess again."]


def chat_three_turns(client: openai.OpenAI, stream: bool) -> list[str]:
    messages, answers = [SYSTEM], []
    for text in USER:
        messages.append({"role": "user", "content": text})
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model="policy",
                    messages=messages,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            assert finish == "stop"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        else:
            out = client.chat.completions.create(model="policy", messages=messages, max_tokens=64)
            assert out.object == "chat.completion" and out.choices[0].finish_reason == "stop"
            assert out.choices[0].message.role == "assistant"
            assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
            answer = out.choices[0].message.content
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return answers


@pytest.mark.parametrize("stream", [False, True])
def test_three_turn_chat_records_exact_ids(gateway, stream):  # noqa: F811
    (r,) = gateway.create(group_id="g")
    client = openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    answers = chat_three_turns(client, stream)

    tok = gateway.engine.tokenizer
    assert len(gateway.engine.calls) == 3
    # The agent saw the decoded response ids.
    for answer, (_, gen) in zip(answers, gateway.engine.calls, strict=True):
        assert answer == tok.decode(gen.response_ids, skip_special_tokens=True)
    # The store holds exactly the ids the engine saw and produced.
    detail = gateway.admin.get(f"/rollouts/{r['rollout_id']}").json()
    assert detail["state"] == "running" and detail["n_turns"] == 3
    for k, (turn, (prompt, gen)) in enumerate(
        zip(detail["turns"], gateway.engine.calls, strict=True)
    ):
        assert turn["index"] == k
        assert turn["prompt_ids"] == prompt
        assert turn["response_ids"] == gen.response_ids
        assert turn["response_logprobs"] == gen.response_logprobs  # exact: multiples of 1/8
        assert (turn["model_version"], turn["finish_reason"]) == (
            gen.model_version,
            gen.finish_reason,
        )
    # The prompt the engine saw is the chat template rendering of the messages.
    first = tok.apply_chat_template(
        [SYSTEM, {"role": "user", "content": USER[0]}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert detail["turns"][0]["prompt_ids"] == list(first)
    # Each turn's prompt starts with the previous turn's context (prompt + response ids).
    for prev, nxt in zip(detail["turns"], detail["turns"][1:], strict=False):
        context = prev["prompt_ids"] + prev["response_ids"]
        assert nxt["prompt_ids"][: len(context)] == context
        assert len(nxt["prompt_ids"]) > len(context)


def test_async_client_and_token_id_extension(gateway):  # noqa: F811
    import asyncio

    (r,) = gateway.create()

    async def main():
        client = openai.AsyncOpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        out = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        await client.close()
        return out

    out = asyncio.run(main())
    prompt, gen = gateway.engine.calls[-1]
    extra = out.model_extra
    assert extra["prompt_token_ids"] == prompt
    assert out.choices[0].model_extra["token_ids"] == gen.response_ids
    assert extra["tracetrain"] == {
        "rollout_id": r["rollout_id"],
        "turn_index": 0,
        "model_version": 0,
    }
    assert [c.logprob for c in out.choices[0].logprobs.content] == gen.response_logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_completions_with_text_and_token_prompts(gateway, stream):  # noqa: F811
    (r,) = gateway.create()
    client = openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    tok = gateway.engine.tokenizer
    for prompt in ("The answer is", tok.encode("The answer is")):
        if stream:
            chunks = list(
                client.completions.create(model="m", prompt=prompt, max_tokens=5, stream=True)
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(model="m", prompt=prompt, max_tokens=5)
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        seen, gen = gateway.engine.calls[-1]
        assert seen == tok.encode("The answer is")
        assert len(gen.response_ids) == 5 and finish == "length"
        assert text == tok.decode(gen.response_ids, skip_special_tokens=True)
    turns = gateway.admin.get(f"/rollouts/{r['rollout_id']}").json()["turns"]
    assert [t["finish_reason"] for t in turns] == ["length", "length"]


def test_tool_calls_are_parsed_when_tools_are_offered(tmp_path):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    engine = FakeEngine(reply=lambda k, p: "Let me compute. " + call)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    with live_gateway(tmp_path, engine) as gw:
        (r,) = gw.create()
        client = openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "What is 6*7?"}]
        out = client.chat.completions.create(model="m", messages=msgs, tools=tools)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me compute."
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "calculator"
        assert json.loads(tc.function.arguments) == {"expression": "6*7"}
        # The tools reached the chat template: the prompt mentions the tool.
        prompt, _ = engine.calls[-1]
        assert '"calculator"' in engine.tokenizer.decode(prompt)
        # Without tools the same text is plain content.
        out = client.chat.completions.create(model="m", messages=msgs)
        assert out.choices[0].message.tool_calls is None and call in out.choices[0].message.content
        gw.admin.close()
