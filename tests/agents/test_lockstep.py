"""Lockstep batching (agents/lockstep.py): a local engine's batch closes when every live agent waits
on a call, whatever the order and timing of their calls; the runner's count of live agents never
drops before an agent returns, and comes back to 0."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.agents.lockstep import AgentCount, Lockstep
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.models.tiny import build_model, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, seed=0)


def prompts(tok, n: int) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": f"Guess {k}."}],
                                    add_generation_prompt=True)["input_ids"] for k in range(n)]


async def play(engine: LocalEngine, lockstep: Lockstep, ps: list[list[int]], turns: list[int],
               rng: random.Random) -> tuple[list[list[list[int]]], list[int]]:
    """len(ps) agents, agent k making turns[k] calls (each after a random delay, seeded by
    `rng`: another rng, another order of arrival), counted as the runner counts them. Returns
    each agent's responses and the size of each batch the engine decoded."""
    count = AgentCount(lockstep, len(ps), len(ps))
    sizes = []
    run = engine._run

    def recording(batch, *join):
        sizes.append(len(batch))  # as it starts (requests that join it: engine.stats["joined"])
        return run(batch, *join)

    engine._run = recording

    async def agent(k: int) -> list[list[int]]:
        out, prompt = [], ps[k]
        for turn in range(turns[k]):
            await asyncio.sleep(rng.uniform(0, 0.02))
            gen = await engine.generate(prompt, SamplingParams(max_tokens=3, temperature=1.0,
                                                               seed=1000 * k + turn))
            out.append(gen.response_ids)
            prompt = prompt + gen.response_ids
        await asyncio.sleep(rng.uniform(0, 0.02))  # work after the last call, still counted
        count.ended()
        return out

    try:
        return list(await asyncio.gather(*(agent(k) for k in range(len(ps))))), sizes
    finally:
        engine._run = run
        count.close()


def test_batches_are_the_agents_rounds_whatever_the_arrival_order(model, tok):
    """Agents of 1..3 turns: each round is one batch of the agents still playing (3, 3, 2, 1 ...),
    and every response is the same whatever order the calls came in."""
    ps = prompts(tok, 6)
    turns = [1, 2, 3, 3, 2, 1]
    runs = []
    for order in range(3):
        lockstep = Lockstep()
        engine = LocalEngine(model, tok, lockstep=lockstep, batch_window_ms=0)
        runs.append(asyncio.run(play(engine, lockstep, ps, turns, random.Random(order))))
        assert lockstep.agents == 0 and lockstep.waiting == 0
        assert engine.stats["joined"] == 0  # (no call joins a batch under a lockstep)
    for responses, sizes in runs:
        assert sizes == [6, 4, 2]  # round k: the agents with more than k turns
        assert responses == runs[0][0]


def test_without_lockstep_the_batches_follow_the_arrivals(model, tok):
    """The control: by arrival (no window), the same calls start batches of other sizes, and
    calls that arrive while one decodes join it (engines/join.py)."""
    ps = prompts(tok, 6)
    lockstep = Lockstep()  # counted, but the engine does not wait on it
    engine = LocalEngine(model, tok, batch_window_ms=0)
    _, sizes = asyncio.run(play(engine, lockstep, ps, [1, 2, 3, 3, 2, 1], random.Random(0)))
    assert sum(sizes) + engine.stats["joined"] == 12 and sizes != [6, 4, 2]


def test_an_agent_that_returns_without_calling_releases_the_others(model, tok):
    async def main():
        lockstep = Lockstep()
        engine = LocalEngine(model, tok, lockstep=lockstep)
        count = AgentCount(lockstep, 2, 2)
        call = asyncio.ensure_future(engine.generate(prompts(tok, 1)[0], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.1)
        assert not call.done()  # the other agent may still call
        count.ended()  # it returned without calling
        gen = await asyncio.wait_for(call, 30)
        count.ended()
        assert gen.response_ids and lockstep.agents == 0 and lockstep.waiting == 0
        await engine.aclose()

    asyncio.run(main())


def test_a_call_given_up_stops_counting(model, tok):
    async def main():
        lockstep = Lockstep()
        engine = LocalEngine(model, tok, lockstep=lockstep)
        AgentCount(lockstep, 2, 2)
        call = asyncio.ensure_future(engine.generate(prompts(tok, 1)[0], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.05)
        assert lockstep.waiting == 1
        call.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert lockstep.waiting == 0
        await engine.aclose()

    asyncio.run(main())


@settings(max_examples=200)
@given(st.integers(1, 40), st.integers(1, 12), st.randoms(use_true_random=False))
def test_the_runner_counts_min_of_unfinished_and_concurrency(n, k, rnd):
    """As agents end in any order, the count is min(unfinished, k): never below the agents that
    will still call (a queued one takes a freed slot), 0 at the end."""
    lockstep = Lockstep()
    count = AgentCount(lockstep, n, k)
    for unfinished in range(n, 0, -1):
        assert lockstep.agents == min(unfinished, k)
        count.ended()
    assert lockstep.agents == 0
    count.close()
    assert lockstep.agents == 0
    partial = AgentCount(lockstep, n, k)
    for _ in range(rnd.randrange(n)):
        partial.ended()
    partial.close()  # a cancelled call: whatever did not end stops counting
    assert lockstep.agents == 0
    partial.ended()  # a worker's late news of an agent of a closed call: counted out once only
    assert lockstep.agents == 0
