"""The context-rewriting example end to end through a live gateway: its rollouts span several rows,
the breaks are classified as context_rewrite, and every rollout still gets 1/R of the update."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import torch
from gateway_fixtures import FakeEngine, live_gateway

from tracetrain.agents.runner import GatewayClient, run_rollouts
from tracetrain.objective.minibatch import plan_step
from tracetrain.rows.aggregate import aggregate

TASK = Path(__file__).resolve().parents[1] / "examples" / "guess" / "task.py"


def load_example():
    spec = importlib.util.spec_from_file_location("guess_task", TASK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summarizing_agent_rows_breaks_and_mass(tmp_path):
    guess = load_example()
    # The engine always guesses 5; targets 1..4 make every game last its 3 turns, 5 ends it at once.
    engine = FakeEngine(reply=lambda k, prompt: "5")
    specs = [{"rollout_id": f"r{t}", "group_id": "g", "task": {"target": t, "high": 8, "max_turns": 3}}
             for t in (1, 2, 3, 4, 5)]
    with live_gateway(tmp_path, engine) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            try:
                return await run_rollouts(client, specs, guess.summarizing_agent, concurrency=8,
                                          timeout_s=30, client_extra={"model": "policy"})
            finally:
                await client.aclose()

        results = asyncio.run(main())
        assert [r.reward for r in results] == [0.0, 0.0, 0.0, 0.0, 1.0]
        rollouts = gw.store.load_rollouts(rollout_ids=[s["rollout_id"] for s in specs])
        # The gateway sees each rewritten history match no earlier turn: rendered in full.
        how = [(t.context, t.context_reason) for s in specs for t in gw.store.get_turns(s["rollout_id"])]
    batch, metrics, breaks = aggregate(rollouts, max_prompt_length=512, max_response_length=64,
                                       pad_token_id=0, tokenizer=engine.tokenizer, return_breaks=True)
    # 4 games of 3 turns: each later turn rewrites the context (2 breaks each); 1 game of 1 turn.
    assert metrics["n_rows"] == 4 * 3 + 1
    assert metrics["n_multi_row_rollouts"] == 4 and metrics["max_rows_per_rollout"] == 3
    assert {b.kind for b in breaks} == {"context_rewrite"} and len(breaks) == 8
    assert how.count(("rendered", "first_turn")) == 5 and how.count(("rendered", "no_match")) == 8
    (mb,) = plan_step(batch.response_mask, batch.rollout_index, mode="rollout-mean")
    row_mass = batch.response_mask.sum(1) * mb.row_scales
    per_rollout = torch.zeros(batch.n_rollouts).index_add_(0, batch.rollout_index, row_mass.float())
    assert torch.allclose(per_rollout, torch.full((5,), 1 / 5))
