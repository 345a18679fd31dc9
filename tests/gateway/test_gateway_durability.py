"""Durability: the gateway (`python -m tracetrain.gateway.serve`, upstream mode, a subprocess) is
killed with SIGKILL in the middle of traffic; restarted on the same file, it has every rollout,
turn and reward it acknowledged with a 2xx, and the agents' keys still work."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal

import httpx
import pytest
from fake_upstream import FakeUpstream
from gateway_fixtures import save_tiny_tokenizer, spawn_gateway

N_AGENTS = 12


async def traffic(url: str, admin_key: str, acked: dict, stop_after: int, proc) -> None:
    """Agents chat and post rewards until `stop_after` turns are acknowledged, then kill -9."""
    admin = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(timeout=30) as http:
        made = await http.post(url + "/rollouts", json={"rollouts": [{}] * N_AGENTS}, headers=admin)
        for r in made.json()["rollouts"]:
            acked["rollouts"][r["rollout_id"]] = r
        killed = asyncio.Event()

        async def agent(r):
            auth = {"Authorization": f"Bearer {r['api_key']}"}
            k = 0
            while not killed.is_set():
                k += 1
                try:
                    resp = await http.post(
                        r["base_url"] + "/chat/completions",
                        json={
                            "messages": [{"role": "user", "content": f"turn {k}"}],
                            "max_tokens": 6,
                            "return_token_ids": True,
                        },
                        headers=auth,
                    )
                    if resp.status_code == 200:
                        body = resp.json()
                        acked["turns"].append(
                            (
                                r["rollout_id"],
                                body["tracetrain"]["turn_index"],
                                body["prompt_token_ids"],
                                body["choices"][0]["token_ids"],
                            )
                        )
                    if k % 3 == 0:
                        rew = await http.post(
                            url + f"/rollouts/{r['rollout_id']}/rewards",
                            json={"reward": k / 100},
                            headers=auth,
                        )
                        if rew.status_code == 200:
                            acked["rewards"].append(
                                (r["rollout_id"], rew.json()["event_id"], k / 100)
                            )
                except httpx.TransportError:
                    return  # the gateway is gone; this request was never acknowledged
                if len(acked["turns"]) >= stop_after and not killed.is_set():
                    killed.set()
                    os.kill(proc.pid, signal.SIGKILL)

        await asyncio.gather(*(agent(r) for r in acked["rollouts"].values()))


@pytest.mark.slow
def test_acknowledged_records_survive_kill_9(tmp_path):
    db = tmp_path / "gw.db"
    key = "admin-" + secrets.token_hex(16)
    tokdir = save_tiny_tokenizer(tmp_path / "tok")
    acked: dict = {"rollouts": {}, "turns": [], "rewards": []}
    with FakeUpstream(response_len=6) as fake:
        proc, url = spawn_gateway(db, fake.url, tokdir, key)
        try:
            asyncio.run(traffic(url, key, acked, stop_after=150, proc=proc))
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
        assert len(acked["turns"]) >= 150 and acked["rewards"]

        proc, url = spawn_gateway(db, fake.url, tokdir, key)
        try:
            admin = httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
            )
            detail = {rid: admin.get(f"/rollouts/{rid}").json() for rid in acked["rollouts"]}
            for rid, index, prompt, response in acked["turns"]:
                turns = detail[rid]["turns"]
                assert index < len(turns), (rid, index)
                assert (turns[index]["prompt_ids"], turns[index]["response_ids"]) == (
                    prompt,
                    response,
                )
            for d in detail.values():  # indices stay dense after the crash
                assert [t["index"] for t in d["turns"]] == list(range(d["n_turns"]))
            for rid, event_id, value in acked["rewards"]:
                events = admin.get(f"/rollouts/{rid}/events").json()["events"]
                assert any(e["event_id"] == event_id and e["reward"] == value for e in events)
            # The agents' keys still work after the restart, and turns continue in order.
            r = next(iter(acked["rollouts"].values()))
            n = detail[r["rollout_id"]]["n_turns"]
            again = httpx.post(
                url + f"/rollouts/{r['rollout_id']}/v1/chat/completions",  # new port
                json={"messages": [{"role": "user", "content": "after restart"}], "max_tokens": 4},
                headers={"Authorization": f"Bearer {r['api_key']}"},
                timeout=60,
            )
            assert again.status_code == 200 and again.json()["tracetrain"]["turn_index"] == n
            admin.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
