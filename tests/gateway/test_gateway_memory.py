"""Bounded memory: turns live in the store, not in the process. The gateway (a subprocess, upstream
mode against the fake vLLM server) serves 10,000 requests from 32 concurrent agents (completions,
and chats whose last message is new each time, which fill its bounded prompt caches); its resident
memory grows by less than 100 MB (a peer's in-memory gateway grew from 64 MB to 930 MB over 12,000)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import aiohttp
import httpx
import pytest
from fake_upstream import spawn_fake_upstream
from gateway_fixtures import save_tiny_tokenizer, spawn_gateway

N_REQUESTS, N_AGENTS, WARMUP = 10_000, 32, 500
SYSTEM = {"role": "system", "content": "You are playing a game. Guess the secret number. " * 8}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def drive(rollouts: list[dict], n: int) -> int:
    """n completions spread over the agents; returns how many were answered 200."""
    left, ok = n, 0
    prompt = list(
        range(3, 3 + 200)
    )  # 200 prompt tokens, 16 response tokens: ~1 KB recorded per turn

    async def agent(r):
        nonlocal left, ok
        headers = {"Authorization": f"Bearer {r['api_key']}"}
        async with aiohttp.ClientSession(headers=headers) as s:
            while left > 0:
                left -= 1
                if left % 2:  # a completion from token ids
                    route, body = "/completions", {"prompt": prompt, "max_tokens": 16, "seed": left}
                else:  # a chat whose last message is new: fills the gateway's prompt caches
                    messages = [SYSTEM, {"role": "user", "content": f"Guess again, try {left}."}]
                    route, body = "/chat/completions", {"messages": messages, "max_tokens": 16}
                async with s.post(r["base_url"] + route, json=body) as resp:
                    await resp.read()
                    ok += resp.status == 200

    await asyncio.gather(*(agent(r) for r in rollouts))
    return ok


@pytest.mark.slow
def test_rss_growth_over_10k_requests_is_bounded(tmp_path):
    key = "admin-" + secrets.token_hex(16)
    fake, fake_url = spawn_fake_upstream(response_len=64)
    proc = None
    try:
        proc, url = spawn_gateway(
            tmp_path / "mem.db", fake_url, save_tiny_tokenizer(tmp_path / "tok"), key
        )
        made = httpx.post(
            url + "/rollouts",
            json={"rollouts": [{}] * N_AGENTS},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        ).json()["rollouts"]
        assert asyncio.run(drive(made, WARMUP)) == WARMUP
        before = rss_mb(proc.pid)
        assert asyncio.run(drive(made, N_REQUESTS)) == N_REQUESTS
        after = rss_mb(proc.pid)
        turns = sum(
            httpx.get(
                f"{url}/rollouts/{r['rollout_id']}?turns=false",
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            ).json()["n_turns"]
            for r in made
        )
        assert turns == WARMUP + N_REQUESTS  # every request was recorded ...
        assert after - before < 100, (before, after)  # ... on disk, not in the process
        print(f"gateway RSS {before:.0f} MB -> {after:.0f} MB over {N_REQUESTS} requests")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        fake.kill()
        fake.wait()
