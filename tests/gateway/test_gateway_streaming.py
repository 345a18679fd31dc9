"""Real token streaming (gateway/streaming.py): the text reaches the client while the engine is
still decoding, on chat completions, text completions, the Responses API and Anthropic Messages,
driven by the real SDKs through a live gateway on loopback. What is streamed is always the start
of the final answer (property test over real tokenizers: stop strings, tool-call markers, UTF-8
characters cut between tokens); tool calls come once parsed; the turn is recorded before the last
event; a client that leaves mid-stream stops the engine and leaves no turn; an engine failure
before the first token is a plain HTTP error, after it an error event."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import pytest
import real_tokenizers
from gateway_fixtures import CALC_TOOLS, ScriptedEngine, hermes_call, live_gateway, tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

from tracetrain.engines.base import EngineError, Generation, SamplingParams, stop_string_in
from tracetrain.gateway.streaming import TextDeltas
from tracetrain.gateway.tool_calls import PARSERS
from tracetrain.gateway.turn import final_text as _text

# ------------------------------------------------------------------ what may be streamed

TOKENIZERS = {"tiny": tiny_tokenizer, "qwen": real_tokenizers.qwen}
pieces = st.sampled_from(
    ["Hello", " world", ",", " ", "\n", "é", "中文", "😀", "<tool", "_call>", "<", "STOP", "ST",
     "</tool_call>", "{", "}", "  ", "42", " the", "end."]
)


def engine_ids(tok, text: str, params: SamplingParams) -> tuple[list[int], str]:
    """What an engine makes when the model writes `text` then eos: up to the first stop."""
    out = []
    for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]:
        out.append(t)
        if t == tok.eos_token_id or (params.stop and stop_string_in(tok, out, params.stop)):
            return out, "stop"
    return out, "stop"


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(TOKENIZERS)),
    words=st.lists(pieces, max_size=14),
    call=st.booleans(),
    tools=st.booleans(),
    stops=st.sampled_from([(), ("STOP",), ("\n\n", "end.")]),
)
def test_streamed_text_is_always_the_start_of_the_final_answer(name, words, call, tools, stops):
    tok = TOKENIZERS[name]()
    text = "".join(words) + (hermes_call("calc", {"expr": "1+2"}) if call else "")
    params = SamplingParams(max_tokens=512, stop=stops, stop_token_ids=(tok.eos_token_id,))
    ids, finish = engine_ids(tok, text, params)
    parser = PARSERS["hermes"]
    deltas = TextDeltas()
    deltas.start(tok, params, parser.markers if tools else (), parser.safe if tools else None, 1)
    gen = Generation(ids, [0.0] * len(ids), finish, 0)
    final, _ = _text(tok, gen, params, parser.markers if tools else ())
    content = (parser.parse(final)[0] if tools else final) or ""
    sent = ""
    for t in ids:
        deltas.add([t])
        while not deltas.queue.empty():
            sent += deltas.queue.get_nowait()
        assert content.startswith(sent), (sent, content)
        if tools:
            assert "<tool_call>" not in sent
        assert not any(s in sent for s in stops)
    assert sent == deltas.sent and sent + deltas.rest(content) == content


def test_text_is_streamed_as_it_comes_not_held_to_the_end():
    """Plain text goes out token by token (but the whitespace at its end, which a tool call
    after it would strip), a cut UTF-8 character once whole, a stop string's start not at all."""
    tok = real_tokenizers.qwen()
    params = SamplingParams(stop=("STOP",))
    deltas = TextDeltas()
    deltas.start(tok, params, (), None, 1)
    seen = []
    for t in tok.encode("Hello there, 😀 friend ST", add_special_tokens=False):
        deltas.add([t])
        seen.append(deltas.sent)
    assert seen[0] == "Hello" and "Hello there," in seen
    assert not any(s.endswith("\ufffd") for s in seen)  # the emoji's bytes span several ids
    assert seen[-1] == "Hello there, 😀 friend"  # " ST" may begin "STOP": held back


# ------------------------------------------------------------------ through the gateway


def recorded(gw, rollout_id: str) -> int:
    return len(gw.admin.get(f"/rollouts/{rollout_id}").json()["turns"])


@pytest.fixture
def slow(tmp_path):
    """A gateway whose scripted engine makes a token every 20 ms."""
    with live_gateway(tmp_path, ScriptedEngine(token_delay=0.02)) as gw:
        yield gw
        gw.admin.close()


def test_chat_stream_sends_text_before_the_turn_ends_then_the_parsed_call(slow):
    gw = slow
    (r,) = gw.create(1)
    gw.engine.say("Let me add these two numbers. " + hermes_call("calc", {"expr": "17+25"}))
    client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "17+25?"}], tools=CALC_TOOLS,
        stream=True, stream_options={"include_usage": True},
    )
    text, calls, log = "", [], []
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            text += delta.content
            log.append(("text", recorded(gw, r["rollout_id"])))
        if delta.tool_calls:
            calls += delta.tool_calls
        if chunk.choices[0].finish_reason:
            log.append(("finish", recorded(gw, r["rollout_id"])))
            finish = chunk.choices[0].finish_reason
    texts = [n for kind, n in log if kind == "text"]
    assert len(texts) >= 4 and texts[0] == 0  # several deltas, the first before any turn exists
    assert log[-1] == ("finish", 1)  # the turn is recorded before the last event
    assert text == "Let me add these two numbers." and "<tool" not in text
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["calc"]
    assert json.loads(calls[0].function.arguments) == {"expr": "17+25"}
    (turn,) = gw.admin.get(f"/rollouts/{r['rollout_id']}").json()["turns"]
    assert turn["response_ids"] == gw.engine.streamed[0]  # streamed ids = the recorded ids
    assert usage.completion_tokens == len(turn["response_ids"])


def test_text_completion_streams_too(slow):
    gw = slow
    (r,) = gw.create(1)
    gw.engine.say("one two three four five six")
    client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    parts = [(c.choices[0].text, recorded(gw, r["rollout_id"]))
             for c in client.completions.create(model="policy", prompt="count:", stream=True)]
    assert "".join(p for p, _ in parts) == "one two three four five six"
    assert sum(1 for p, n in parts if p and n == 0) >= 3


def test_responses_and_anthropic_streams_send_text_as_it_comes(slow):
    gw = slow
    r1, r2 = gw.create(2)
    answer = "Twelve plus thirty is forty two, I think."
    gw.engine.say(answer)
    client = OpenAI(base_url=r1["base_url"], api_key=r1["api_key"], max_retries=0)
    deltas = []
    with client.responses.stream(model="policy", input="12+30?") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append((event.delta, recorded(gw, r1["rollout_id"])))
        final = stream.get_final_response()
    assert "".join(d for d, _ in deltas) == answer == final.output_text
    assert sum(1 for _, n in deltas if n == 0) >= 3

    gw.engine.say(answer)
    claude = anthropic.Anthropic(base_url=r2["base_url"].removesuffix("/v1"), api_key=r2["api_key"],
                                 max_retries=0)
    texts = []
    with claude.messages.stream(model="policy", max_tokens=64,
                                messages=[{"role": "user", "content": "12+30?"}]) as stream:
        for text in stream.text_stream:
            texts.append((text, recorded(gw, r2["rollout_id"])))
        message = stream.get_final_message()
    assert "".join(t for t, _ in texts) == answer == message.content[0].text
    assert sum(1 for _, n in texts if n == 0) >= 3
    assert message.usage.input_tokens == len(gw.engine.calls[-1][0])


def test_a_client_that_leaves_mid_stream_stops_the_engine_and_leaves_no_turn(slow):
    gw = slow
    (r,) = gw.create(1)
    gw.engine.say("word " * 200)
    headers = {"Authorization": f"Bearer {r['api_key']}"}
    body = {"model": "policy", "messages": [{"role": "user", "content": "talk"}], "stream": True}
    with httpx.stream("POST", r["base_url"] + "/chat/completions", json=body, headers=headers,
                      timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any('"content"' in line for line in got)
    deadline = time.monotonic() + 10
    while gw.engine.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.engine.cancelled == 1  # the engine stopped decoding for the client that left
    assert len(gw.engine.streamed[0]) < 100
    time.sleep(0.2)
    assert recorded(gw, r["rollout_id"]) == 0  # no partial turn
    gw.engine.say("Still here.")  # the rollout goes on
    client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    again = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert again.choices[0].message.content == "Still here." and recorded(gw, r["rollout_id"]) == 1


class FailingEngine(ScriptedEngine):
    """Fails after `after` tokens of its answer (None: answers normally)."""

    after: int | None = None

    async def generate(self, prompt_ids, params, on_tokens=None):
        if self.after is None:
            return await super().generate(prompt_ids, params, on_tokens)
        for t in self.script.popleft()[: self.after]:
            on_tokens([t])
            await asyncio.sleep(0.01)
        raise EngineError("upstream dropped the connection", 503)


def test_engine_failure_before_the_first_token_is_an_http_error_after_it_an_event(tmp_path):
    with live_gateway(tmp_path, FailingEngine()) as gw:
        (r,) = gw.create(1)
        headers = {"Authorization": f"Bearer {r['api_key']}"}
        url = r["base_url"] + "/chat/completions"
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        gw.engine.after = 0
        gw.engine.say("never sent")
        refused = httpx.post(url, json=body, headers=headers, timeout=30)
        assert refused.status_code == 503 and "dropped" in refused.json()["error"]["message"]
        gw.engine.after = 3
        gw.engine.say("Hello there my friend, how are you")
        cut = httpx.post(url, json=body, headers=headers, timeout=30)
        assert cut.status_code == 200
        events = [json.loads(e[6:]) for e in cut.text.split("\n\n") if e.startswith("data: {")]
        assert events[-1]["error"]["code"] == 503 and "dropped" in events[-1]["error"]["message"]
        assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events)
        assert cut.text.endswith("data: [DONE]\n\n")
        assert recorded(gw, r["rollout_id"]) == 0
        gw.admin.close()


def test_local_engine_streams_through_the_gateway_as_it_decodes(tmp_path):
    """The tiny transformers model behind the gateway: the streamed text equals the answer the
    same seed gives without streaming, and it comes in many chunks while decoding."""
    from tracetrain.engines.local import LocalEngine
    from tracetrain.models.tiny import build_model

    tok = tiny_tokenizer()
    engine = LocalEngine(build_model(tok, seed=0), tok)
    with live_gateway(tmp_path, engine) as gw:
        r1, r2 = gw.create(2)
        ask = {"model": "policy", "messages": [{"role": "user", "content": "Guess a number."}],
               "max_tokens": 40, "seed": 7, "temperature": 1.0}
        whole = OpenAI(base_url=r1["base_url"], api_key=r1["api_key"], max_retries=0)
        expected = whole.chat.completions.create(**ask).choices[0].message.content
        live = OpenAI(base_url=r2["base_url"], api_key=r2["api_key"], max_retries=0)
        arrivals, pieces = [], []
        for chunk in live.chat.completions.create(**ask, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                arrivals.append(recorded(gw, r2["rollout_id"]))
        assert "".join(pieces) == expected
        assert len(pieces) >= 5 and arrivals[0] == 0
        gw.admin.close()
