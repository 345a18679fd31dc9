"""The runner: launch one agent per rollout against the gateway, with bounded concurrency.

An agent is what agents/contract.py says (`Agent`: `async def agent(task, client) -> reward`,
`client` an `AgentClient`), or a command run as a subprocess (`CommandAgent`: the same values as
OPENAI_BASE_URL / OPENAI_API_KEY / TRACETRAIN_* variables; its reward through the gateway).

State of each rollout (set through the gateway's admin API): running from the agent's first model
call; succeeded when it returns or exits 0; failed on an exception or a non-zero exit (the error
is kept); timed_out past `timeout_s` (a subprocess is killed with its whole process group).
Failed and timed-out rollouts are never given reward 0 here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from tracetrain.agents.contract import Agent
from tracetrain.agents.lockstep import AgentCount, Lockstep

AgentFn = Agent  # (the contract's Protocol; runner_ray and workers name it so)
log = logging.getLogger("tracetrain.runner")
MAX_BATCH = 10_000  # rollouts per create or bulk patch call (the gateway's limit)


class GatewayError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class GatewayClient:
    """The runner's and trainer's side of the gateway: admin routes over HTTP (aiohttp: its pool
    stays O(1) per request with hundreds of agents, where httpx's scans every connection)."""

    def __init__(self, url: str, admin_key: str, *, timeout_s: float = 60.0, max_connections: int = 64):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {admin_key}"}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._finishes: list[tuple[dict, asyncio.Future]] = []  # waiting for the next PATCH /rollouts
        self._flusher: asyncio.Task | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.headers, timeout=self.timeout,
                # Close idle connections well before the server does (uvicorn: 5 s by default),
                # so a request never goes out on a connection the server is closing.
                connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=2.0),
            )
        return self._session

    async def _call(self, method: str, path: str, **kw) -> Any:
        for attempt in range(3):
            try:
                return await self._call_once(method, path, **kw)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError):
                if attempt == 2:  # a kept-alive connection closed under us: the request never ran
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))

    async def _call_once(self, method: str, path: str, **kw) -> Any:
        async with self.session.request(method, self.url + path, **kw) as r:
            body = await r.read()
            if r.status >= 400:
                raise GatewayError(r.status, f"gateway {method} {path} -> {r.status}: "
                                   f"{body[:500].decode(errors='replace')}")
            return json.loads(body) if body else None

    async def create_rollouts(self, rollouts: list[dict]) -> list[dict]:
        out = []
        for k in range(0, len(rollouts), MAX_BATCH):
            body = {"rollouts": rollouts[k : k + MAX_BATCH]}
            out += (await self._call("POST", "/rollouts", json=body))["rollouts"]
        return out

    async def set_state(self, rollout_id: str, state: str, error: str | None = None) -> dict:
        body: dict[str, Any] = {"state": state}
        if error is not None:
            body["error"] = error[-100_000:]
        return await self._call("PATCH", f"/rollouts/{rollout_id}", json=body)

    async def finish(self, rollout_id: str, state: str, error: str | None = None,
                     reward: float | None = None) -> dict:
        """End a rollout: its state, and the reward its agent returned (kept as the rollout's
        reward; None leaves what the agent reported through the gateway). A rollout whose agent
        never called the model is still queued: it passes through running. Finishes that come
        in while one call is on its way go together in the next (one PATCH /rollouts)."""
        item: dict[str, Any] = {"rollout_id": rollout_id, "state": state}
        if error is not None:
            item["error"] = error[-100_000:]
        if reward is not None:
            item["reward"] = reward
        done = asyncio.get_running_loop().create_future()
        self._finishes.append((item, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._send_finishes())
        result = await done
        if result["status"] == 409:  # queued (no model call yet): through running, then again
            await self.set_state(rollout_id, "running")
            body = {k: v for k, v in item.items() if k != "rollout_id"}
            return await self._call("PATCH", f"/rollouts/{rollout_id}", json=body)
        if result["status"] != 200:
            raise GatewayError(result["status"], f"gateway PATCH /rollouts, rollout {rollout_id!r} "
                               f"-> {result['status']}: {result['error']}")
        return result["rollout"]

    async def _send_finishes(self) -> None:
        await asyncio.sleep(0)  # the finishes of this event-loop turn join the first call
        while self._finishes:
            batch, self._finishes = self._finishes[:MAX_BATCH], self._finishes[MAX_BATCH:]
            try:
                out = await self._call("PATCH", "/rollouts", json={"rollouts": [i for i, _ in batch]})
                results = list(zip(batch, out["rollouts"], strict=True))
            except asyncio.CancelledError:  # aclose(): nobody waits forever
                for _, done in batch + self._finishes:
                    done.cancel()
                raise
            except Exception as e:  # every waiter of the call hears why
                for _, done in batch:
                    if not done.done():
                        done.set_exception(e)
                continue
            for (_, done), result in results:
                if not done.done():  # (its waiter may have been cancelled)
                    done.set_result(result)

    async def engine(self, name: str, action: str) -> dict:
        """action: pause | resume | drain."""
        return await self._call("POST", f"/engines/{name}/{action}")

    async def drain(self, name: str, timeout_s: float = 60.0) -> None:
        """Pause engine `name` and wait until none of its requests is in flight (a request of a
        timed-out agent may still be decoding), asking again every `timeout_s`."""
        while True:
            out = await self._call("POST", f"/engines/{name}/drain", params={"timeout_s": timeout_s})
            if out["drained"]:
                return
            log.warning("engine %r: %d requests still in flight after %g s; waiting on",
                        name, out["in_flight"], timeout_s)

    async def aclose(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
        if self._session is not None:
            await self._session.close()


def agent_http_client(max_connections: int):
    """The HTTP client handed to agents for the openai SDK: its aiohttp-backed client when the
    `aiohttp` extra is there (3-4x less CPU per call with 100+ agents), else httpx."""
    try:
        from openai import DefaultAioHttpClient

        return DefaultAioHttpClient()
    except (ImportError, RuntimeError):
        return httpx.AsyncClient(limits=httpx.Limits(max_connections=max_connections,
                                                     max_keepalive_connections=max_connections))


@dataclass
class RolloutResult:
    rollout_id: str
    group_id: str
    state: str  # succeeded | failed | timed_out
    reward: float | None
    error: str | None = None
    seconds: float = 0.0


@dataclass
class CommandAgent:
    """An agent run as `argv` in a subprocess (its own process group, killed at the timeout)."""

    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)

    async def __call__(self, task: dict, client: dict) -> float | None:
        env = {
            **os.environ,
            **self.env,
            "OPENAI_BASE_URL": client["base_url"],
            "OPENAI_API_KEY": client["api_key"],
            "TRACETRAIN_MODEL": client["model"],
            "TRACETRAIN_ROLLOUT_ID": client["rollout_id"],
            "TRACETRAIN_ROLLOUT_URL": client["rollout_url"],
            "TRACETRAIN_TASK": json.dumps(task),
            "TRACETRAIN_SAMPLING": json.dumps(
                {k: client[k] for k in ("temperature", "top_p", "max_tokens") if k in client}),
        }
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, stderr = await proc.communicate()
        except asyncio.CancelledError:  # timeout or shutdown: kill the whole process group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = stderr.decode(errors="replace")[-4000:]
            raise RuntimeError(f"agent command exited with status {proc.returncode}: {tail}")
        return None  # the command reports its reward through the gateway


def agent_client(created: dict, client_extra: dict, position: int) -> dict:
    """The `client` an agent gets for the rollout `created` (the gateway's record of it), the
    rollout at `position` of its call: a given `seed` becomes that rollout's (`rollout_seed`)."""
    base_url = created["base_url"]
    seed = client_extra.get("seed")
    return {
        **client_extra,
        **({} if seed is None else {"seed": rollout_seed(seed, position)}),
        "base_url": base_url,
        "api_key": created["api_key"],
        "rollout_id": created["rollout_id"],
        "rollout_url": base_url.removesuffix("/").removesuffix("/v1"),
    }


def returned_turn_rewards(value: Any) -> list[dict]:
    """The turn rewards an agent returned, as POST /turn-rewards bodies: {turn: reward} or a list
    of {"turn", "reward", "name"?}; ValueError naming what is wrong (the gateway checks the rest:
    finite numbers, turns that exist, names)."""
    if isinstance(value, dict):
        items = [{"turn": k, "reward": v} for k, v in value.items()]
    elif isinstance(value, list) and all(isinstance(x, dict) for x in value):
        items = [dict(x) for x in value]
    else:
        raise ValueError("turn_rewards must be {turn index: reward} or a list of "
                         f"{{'turn', 'reward', 'name'}}, got {type(value).__name__}")
    for item in items:
        if type(item.get("turn")) is not int:
            raise ValueError(f"turn_rewards: turn {item.get('turn')!r} is not a turn index (int)")
    return items


async def post_to_rollout(client: dict, path: str, bodies: list[dict]) -> None:
    """POST each of `bodies` to the rollout's `path` (turn-rewards, events) with its key, as the
    agent itself could, on its HTTP client (or a short-lived one); ValueError naming the body the
    gateway refused."""
    http = client.get("http_client")
    own = http is None
    http = httpx.AsyncClient() if own else http
    try:
        for body in bodies:
            r = await http.post(f"{client['rollout_url']}/{path}", json=body,
                                headers={"Authorization": f"Bearer {client['api_key']}"})
            if r.status_code >= 400:
                raise ValueError(f"{path} {body} refused ({r.status_code}): {r.text[:500]}")
    finally:
        if own:
            await http.aclose()


def returned_metrics(value: Any) -> list[dict]:
    """The metrics an agent returned ({name: number}, e.g. types.TOOL_ERRORS) as the body of its
    rollout's `metrics` event (none for {}); ValueError unless a dict of numbers by name."""
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            for k, v in value.items()):
        raise ValueError(f"metrics must be {{name: number}}, got {value!r}"[:300])
    return [{"kind": "metrics", "payload": value}] if value else []


async def call_agent(agent: AgentFn, task: Any, client: dict,
                     timeout_s: float) -> tuple[str, float | None, str | None]:
    """Run one agent under its timeout -> (state, reward, error): succeeded with its returned
    reward (a finite float, or None), timed_out, or failed with the traceback kept. An agent may
    return {"reward": ..., "turn_rewards": ..., "metrics": ...} (see `returned_turn_rewards`,
    `returned_metrics`): its turn rewards are then given, and its metrics posted as a `metrics`
    event, through the gateway before the rollout ends."""
    state, reward, error = "succeeded", None, None
    try:
        reward = await asyncio.wait_for(agent(task, client), timeout_s)
    except asyncio.TimeoutError:
        state, error = "timed_out", f"agent did not finish within {timeout_s} s"
    except Exception as e:  # the agent's failure, kept with its traceback
        state, error = "failed", "".join(traceback.format_exception(e))[-8000:]
    if state == "succeeded" and isinstance(reward, dict):
        returned, reward = reward, reward.get("reward")
        try:
            unknown = set(returned) - {"reward", "turn_rewards", "metrics"}
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)} (reward, turn_rewards, metrics)")
            await post_to_rollout(client, "turn-rewards",
                                  returned_turn_rewards(returned.get("turn_rewards", {})))
            await post_to_rollout(client, "events", returned_metrics(returned.get("metrics", {})))
        except (ValueError, httpx.HTTPError) as e:
            state, error = "failed", f"agent returned unusable turn rewards or metrics: {e}"
    if state == "succeeded" and reward is not None:
        try:
            reward = float(reward)
            if not math.isfinite(reward):
                raise ValueError("it is not finite")
        except (TypeError, ValueError) as e:
            state, error = "failed", f"agent returned an unusable reward {reward!r}: {e}"
    return state, reward if state == "succeeded" else None, error


async def finish_rollout(gateway: GatewayClient, created: dict, state: str, reward: float | None,
                         error: str | None, seconds: float) -> RolloutResult:
    """Record the end of a rollout on the gateway; the result carries the stored reward (returned
    by the agent, or reported by it through the gateway); never a reward unless it succeeded."""
    record = await gateway.finish(created["rollout_id"], state, error, reward)
    reward = record["reward"] if state == "succeeded" else None
    return RolloutResult(created["rollout_id"], created["group_id"], state, reward, error, seconds)


async def run_one(
    gateway: GatewayClient,
    created: dict,
    task: Any,
    agent: AgentFn,
    client_extra: dict,
    timeout_s: float,
    position: int = 0,
    count: AgentCount | None = None,
) -> RolloutResult:
    """Play one rollout and finish it; `count` hears of the agent's return before the finish."""
    start = time.monotonic()
    client = agent_client(created, client_extra, position)
    state, reward, error = await call_agent(agent, task, client, timeout_s)
    if count is not None:
        count.ended()
    return await finish_rollout(gateway, created, state, reward, error, time.monotonic() - start)


def rollout_seed(base: int, position: int) -> int:
    """The sampling seed handed to the agent of the rollout at `position` (agents add the turn
    number): distinct per rollout, a function of (base, position) only, so runs repeat."""
    return (base * 1_000_003 + position) * 1_000 % (2**62)


async def run_rollouts(
    gateway: GatewayClient,
    rollouts: list[dict],
    agent: AgentFn,
    *,
    concurrency: int,
    timeout_s: float,
    client_extra: dict | None = None,
    http_client: Any = None,
    first_position: int = 0,
    lockstep: Lockstep | None = None,
) -> list[RolloutResult]:
    """Create `rollouts` ([{rollout_id, group_id, task}]) on the gateway, run one agent each;
    rollout k gets the seed of position first_position + k (`rollout_seed`). `lockstep`: the
    live agents are counted in it (agents/lockstep.py).

    Results are in the order of `rollouts`. The step never waits longer than about timeout_s per
    wave of `concurrency` agents: every agent is bounded by its timeout. `http_client` (see
    `agent_http_client`) is shared by the agents; without one, one is made for this call (a
    trainer running many steps passes its own: building one costs tens of ms of CPU).
    """
    if http_client is None:
        async with agent_http_client(concurrency) as own:
            return await run_rollouts(gateway, rollouts, agent, concurrency=concurrency,
                                      timeout_s=timeout_s, client_extra=client_extra, http_client=own,
                                      first_position=first_position, lockstep=lockstep)
    created = await gateway.create_rollouts(rollouts)
    sem = asyncio.Semaphore(concurrency)
    extra = {**(client_extra or {}), "http_client": http_client}
    count = AgentCount(lockstep, len(rollouts), concurrency)

    async def bounded(k: int, c: dict, task: Any) -> RolloutResult:
        async with sem:
            return await run_one(gateway, c, task, agent, extra, timeout_s, k, count)

    runs = (bounded(first_position + k, c, r.get("task"))
            for k, (c, r) in enumerate(zip(created, rollouts, strict=True)))
    try:
        return list(await asyncio.gather(*runs))
    finally:
        count.close()


def load_agent(spec: str | Sequence[str] | AgentFn) -> AgentFn:
    """A coroutine function, `module:function`, or a command (list of argv, or a string with spaces)."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and ":" in spec and " " not in spec:
        import importlib

        mod, _, name = spec.partition(":")
        return getattr(importlib.import_module(mod), name)
    argv = spec.split() if isinstance(spec, str) else list(spec)
    if argv and argv[0] == "python":
        argv[0] = sys.executable
    return CommandAgent(argv)
