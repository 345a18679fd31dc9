"""64 concurrent agents x 20 chat calls each (the real AsyncOpenAI SDK) against a fast fake engine:
no turn lost or duplicated, each rollout's turns in the order its agent made them."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest
from gateway_fixtures import FakeEngine, live_gateway

N_AGENTS, N_CALLS = 64, 20


class JitteryEngine(FakeEngine):
    """Answers after a random 0-3 ms so that requests of different agents interleave."""

    async def generate(self, prompt_ids, params):
        await asyncio.sleep(random.random() * 0.003)
        return await super().generate(prompt_ids, params)


@pytest.mark.slow
def test_concurrent_agents_lose_and_duplicate_nothing(tmp_path):
    engine = JitteryEngine(reply=lambda k, p: f"ok {k}")
    with live_gateway(tmp_path, engine) as gw:
        rollouts = gw.create(N_AGENTS)

        async def agent(i: int, r: dict) -> list[int]:
            client = openai.AsyncOpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
            indices = []
            try:
                for k in range(N_CALLS):
                    # Each call starts a fresh conversation naming the agent and the call number.
                    out = await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"agent {i} call {k}"}]
                    )
                    indices.append(out.model_extra["tracetrain"]["turn_index"])
            finally:
                await client.close()
            return indices

        async def main():
            return await asyncio.gather(*(agent(i, r) for i, r in enumerate(rollouts)))

        indices = asyncio.run(main())
        gw.admin.close()
        check(gw, engine, rollouts, indices)


def check(gw, engine, rollouts, indices) -> None:
    # Every call got its own index, in call order.
    assert indices == [list(range(N_CALLS))] * N_AGENTS
    assert len(engine.calls) == N_AGENTS * N_CALLS
    produced = {(tuple(p), tuple(g.response_ids)) for p, g in engine.calls}
    recorded = set()
    tok = engine.tokenizer
    for i, r in enumerate(rollouts):
        turns = gw.store.get_turns(r["rollout_id"])
        assert [t.index for t in turns] == list(range(N_CALLS))
        for k, t in enumerate(turns):
            assert f"agent {i} call {k}" in tok.decode(t.prompt_ids)  # the k-th call's turn
            recorded.add((tuple(t.prompt_ids), tuple(t.response_ids)))
    assert recorded == produced  # nothing lost, nothing invented, no duplicates
    assert len(recorded) == N_AGENTS * N_CALLS
