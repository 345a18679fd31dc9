"""Agents on another host, across a real network boundary on one machine: two network namespaces
joined by a veth pair (made and removed here). `tracetrain train` runs in the first, its gateway
reachable at its veth address (gateway.host / gateway.public_url); the agents are commands run in
the second (`ip netns exec`), an ordinary openai SDK program each, reaching the gateway by that
address only. Per-rollout keys stay mandatory there: no key or a wrong key is refused.

Traffic goes only to the veth addresses of the namespaces this test creates."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TASKS = textwrap.dedent(
    """
    def tasks(n, seed=0, **kw):
        return [{"i": k} for k in range(n)]
    """
)

# The agent: checks where it is and what it may do, then one chat turn and a reward.
AGENT = textwrap.dedent(
    """
    import os, socket, sys
    from urllib.parse import urlsplit
    import httpx
    from openai import OpenAI
    gateway_addr, agent_addr = sys.argv[1], sys.argv[2]
    base = urlsplit(os.environ["OPENAI_BASE_URL"])
    assert base.hostname == gateway_addr, base  # the gateway's public address, not loopback
    with socket.create_connection((base.hostname, base.port), timeout=30) as s:
        assert s.getsockname()[0] == agent_addr, s.getsockname()  # across the veth pair
    models = os.environ["OPENAI_BASE_URL"] + "/models"
    assert httpx.get(models, timeout=30).status_code == 401
    assert httpx.get(models, headers={"Authorization": "Bearer ttr-not-a-key"}, timeout=30).status_code == 401
    client = OpenAI(max_retries=0, timeout=60)
    out = client.chat.completions.create(model=os.environ["TRACETRAIN_MODEL"],
                                         messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert out.choices[0].message.content is not None
    r = httpx.post(os.environ["TRACETRAIN_ROLLOUT_URL"] + "/rewards", json={"reward": 1.0},
                   headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}, timeout=30)
    r.raise_for_status()
    """
)


def ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


@pytest.fixture
def two_namespaces():
    """(gateway namespace, agent namespace, gateway address, agent address), a /30 on a veth pair."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to create network namespaces (apt-get install iproute2)")
    tag = secrets.token_hex(3)
    gw_ns, agent_ns = f"tt-gw-{tag}", f"tt-agent-{tag}"
    net = int(tag, 16) % 64 * 4  # 10.213.<x>.<net>/30: distinct for runs side by side
    gw_addr, agent_addr = f"10.213.{int(tag[:2], 16)}.{net + 1}", f"10.213.{int(tag[:2], 16)}.{net + 2}"
    made = []
    try:
        try:
            ip("netns", "add", gw_ns)
        except RuntimeError as e:
            pytest.skip(f"cannot create a network namespace here: {e}")
        made.append(gw_ns)
        ip("netns", "add", agent_ns)
        made.append(agent_ns)
        ip("link", "add", f"ttg{tag}", "netns", gw_ns, "type", "veth", "peer", "name", f"tta{tag}",
           "netns", agent_ns)
        for ns, dev, addr in ((gw_ns, f"ttg{tag}", gw_addr), (agent_ns, f"tta{tag}", agent_addr)):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield gw_ns, agent_ns, gw_addr, agent_addr
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            ip("netns", "del", ns)


@pytest.mark.slow
@pytest.mark.parametrize("listen", ["veth-address", "wildcard+public_url"])
def test_agents_in_another_namespace_train_through_the_public_address(tmp_path, two_namespaces, listen):
    """Listening on the veth address itself, or on every interface with gateway.public_url
    naming the veth address (the trainer's own calls then go over loopback: only the public URL
    can have told the agents where to go)."""
    gw_ns, agent_ns, gw_addr, agent_addr = two_namespaces
    where = ([f"gateway.host={gw_addr}"] if listen == "veth-address" else
             ["gateway.host=0.0.0.0", f"gateway.public_url=http://{gw_addr}:{{port}}"])
    (tmp_path / "nettask.py").write_text(TASKS)
    (tmp_path / "netagent.py").write_text(AGENT)
    agent = f"ip netns exec {agent_ns} {sys.executable} {tmp_path / 'netagent.py'} {gw_addr} {agent_addr}"
    run_dir = tmp_path / "run"
    env = {**os.environ, "TRACETRAIN_ADMIN_KEY": "admin-" + secrets.token_hex(16), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["ip", "netns", "exec", gw_ns, sys.executable, "-m", "tracetrain", "train",
         str(ROOT / "examples" / "guess" / "config.yaml"),
         f"task={tmp_path / 'nettask.py'}", f"agent={agent}", "warm_start.steps=0",
         "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "rollout.tasks_per_step=2", "rollout.n_per_task=2", "rollout.timeout_s=120",
         "rollout.agent_workers=0", "trainer.collect=step", "trainer.precision=fp32",
         "trainer.steps=1", "trainer.eval_every=0", "engine.threads=1", "trainer.update_threads=1",
         *where, f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (m,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert m["n_failed"] == m["n_timed_out"] == 0, m
    assert m["aggregate/n_rollouts"] == 4 and m["reward_mean"] == 1.0
