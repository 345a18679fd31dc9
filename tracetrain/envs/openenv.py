"""OpenEnv environments (openenv-core's `EnvClient` over a WebSocket), played as an environment
class (envs/environment_class.py) whose one tool is the environment's step.

One rollout of a task `row` (data.train's row, or {"seed": seed + i} with `size`):

    session  = Client(base_url=server).connect()          one session per rollout (a server at its
               max_concurrent_envs is waited on, retrying, until the rollout's timeout)
    result   = await session.reset(**row)                 the server's reset takes the keys its
               signature names; its observation, as text, is appended to the prompt
               (environment_class.py)
    tool     `step`: parameters = the Action model's fields but `metadata` (the client's generic
               Action type, or the server's /schema for a GenericEnvClient); description = the
               Action class's docstring
    a call   result = await session.step(Action(**arguments)); the tool message is the text of
               result.observation (`observation` config function, else its own fields but
               done/reward/metadata as JSON, a lone string field as its text)
    turn reward of model call t = sum of result.reward over the steps its tool calls made (None: 0;
               a turn with no rewarded step has none)
    rollout reward = sum over all steps of result.reward (None: 0)
    metrics  `tool_errors` (types.TOOL_ERRORS): the calls answered {"error": ...} (arguments the
             Action refused, a tool other than `step`), the rollout's `metrics` event
    end      at a reply without tool calls, after a turn whose step said done, or max_turns calls;
             the session is closed when the rollout ends (after a timeout without waiting on it)

Arguments the Action refuses (pydantic's ValidationError here, or the server's VALIDATION_ERROR)
are told to the model as the tool's result {"error": ...}, as TRL does for a tool that raises; any
other failure of reset or step (the server's EXECUTION_ERROR, a lost connection) and a reward that
is not finite raise: a failed rollout with the traceback. A step that hangs is ended by the
rollout's timeout.

`app`: the FastAPI app is served by this process on 127.0.0.1 at a free port, by uvicorn in a
daemon thread, started on the first rollout (in each agent worker process that plays one) and
stopped by close().
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import threading
import typing
from typing import Any

from tracetrain.agents.dataset import TaskRows
from tracetrain.config import OpenEnvConfig
from tracetrain.envs.base import EnvError, Environment, TaskRowsOf, load_object, need, register_env
from tracetrain.envs.environment_class import parse_arguments, prompt_messages, tool_loop
from tracetrain.types import TOOL_ERRORS

KEY = "env"
RETRY_S = (0.05, 1.0)  # backoff while the server is at its session limit: first, most


class AppServer:
    """A FastAPI app served on 127.0.0.1 (a free port) by uvicorn in a daemon thread."""

    def __init__(self, app: Any):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=2))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tracetrain-openenv", daemon=True)
        self.pid = os.getpid()

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except BaseException as e:  # surfaced by start()
            self.error = e

    def start(self, timeout_s: float = 30.0) -> AppServer:
        self.thread.start()
        done = threading.Event()
        for _ in range(int(timeout_s / 0.01)):
            if self.server.started or self.error is not None or not self.thread.is_alive():
                break
            done.wait(0.01)
        if not self.server.started:
            self.stop()
            raise EnvError(f"config key '{KEY}.app': the app did not start: {self.error!r}")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.sock.close()


_SERVERS: dict[str, AppServer] = {}  # app spec -> its server in this process
_SERVERS_LOCK = threading.Lock()


def serve_app(spec: str) -> str:
    """The URL of the app `spec` served by this process (started on first use)."""
    with _SERVERS_LOCK:
        server = _SERVERS.get(spec)
        if server is None or server.pid != os.getpid():  # (a forked worker serves its own)
            server = _SERVERS[spec] = AppServer(load_object(spec, f"{KEY}.app")).start()
        return server.url


def action_type(client_cls: type) -> type | None:
    """The Action model of an EnvClient[Action, Observation, State] subclass (a pydantic model),
    or None (GenericEnvClient's dict, or no parameters)."""
    from pydantic import BaseModel

    for cls in client_cls.__mro__:
        for base in getattr(cls, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                return args[0]
    return None


def step_schema(action_schema: dict, description: str | None) -> dict:
    """The chat tool `step` from the Action's JSON schema, its `metadata` field left out."""
    params = {k: v for k, v in action_schema.items() if k not in ("title", "description")}
    params["properties"] = {k: v for k, v in params.get("properties", {}).items() if k != "metadata"}
    if "required" in params:
        params["required"] = [k for k in params["required"] if k != "metadata"]
    params.pop("additionalProperties", None)
    text = (description or action_schema.get("description") or "").strip()
    return {"type": "function", "function": {
        "name": "step", "description": text or "Take an action in the environment.",
        "parameters": {"type": "object", **params}}}


def observation_text(observation: Any) -> str:
    """An observation's fields but done/reward/metadata as JSON; a lone string field: its text."""
    if hasattr(observation, "model_dump"):
        data = observation.model_dump(exclude={"done", "reward", "metadata"})
    elif isinstance(observation, dict):
        data = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
    else:
        return str(observation)
    if len(data) == 1 and isinstance(next(iter(data.values())), str):
        return next(iter(data.values()))
    return json.dumps(data, default=str)


def step_reward(value: Any, where: str) -> float | None:
    """A StepResult's reward as a float (None stays None); ValueError if it is not finite."""
    if value is None:
        return None
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"OpenEnv StepResult.reward of {where} is {value!r}: not finite")
    return reward


@register_env("openenv")
class OpenEnvEnv(Environment):
    """env.kind openenv: the module docstring's rollout."""

    def rows(self) -> TaskRows | None:
        c: OpenEnvConfig = self.config
        if c.size is None:
            return None
        return TaskRowsOf(c.size, lambda i: {"seed": c.seed + i},
                          f"OpenEnv seeds {c.seed}..{c.seed + c.size - 1}")

    def _client_cls(self) -> type:
        need("openenv.core.env_client", f"{KEY}.client")
        from openenv.core.env_client import EnvClient

        c: OpenEnvConfig = self.config
        cls = load_object(c.client, f"{KEY}.client")
        if not (isinstance(cls, type) and issubclass(cls, EnvClient)):
            raise EnvError(f"config key '{KEY}.client': {c.client} is not an openenv "
                                   "EnvClient subclass")
        return cls

    async def url(self) -> str:
        """The server's URL; `app`: served by this process from the first call on (started off
        the event loop: importing the app and starting uvicorn take a while)."""
        c: OpenEnvConfig = self.config
        return await asyncio.to_thread(serve_app, c.app) if c.app is not None else c.base_url

    async def tool(self, cls: type, url: str) -> tuple[type | None, dict]:
        """(the Action model or None, the `step` tool's schema), once per process."""
        cached = self.__dict__.get("_tool")
        if cached is None:
            action = action_type(cls)
            if action is not None:
                schema = step_schema(action.model_json_schema(), action.__doc__)
            else:  # a GenericEnvClient: the server says what its actions are
                import httpx

                http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
                async with httpx.AsyncClient(timeout=30) as h:
                    r = await h.get(f"{http}/schema")
                    r.raise_for_status()
                schema = step_schema(r.json()["action"], None)
            cached = self.__dict__["_tool"] = (action, schema)
        return cached

    @staticmethod
    async def open_session(cls: type, url: str) -> Any:
        """A client of `cls` connected to `url` (a session of its own on the server)."""
        session = cls(base_url=url)
        try:
            await session.connect()
        except BaseException:
            await _close(session, wait=False)
            raise
        return session

    async def reset(self, cls: type, url: str, row: dict) -> tuple[Any, Any]:
        """(session, reset's StepResult); a server at its session limit is retried with backoff."""
        wait = RETRY_S[0]
        while True:
            session = await self.open_session(cls, url)
            try:
                return session, await session.reset(**row)
            except RuntimeError as e:
                await _close(session, wait=False)
                if "CAPACITY_REACHED" not in str(e):
                    raise
            except BaseException:
                await _close(session, wait=False)
                raise
            await asyncio.sleep(wait)
            wait = min(2 * wait, RETRY_S[1])

    async def agent(self, task: dict, client: dict) -> dict:
        c: OpenEnvConfig = self.config
        cls, url = self._client_cls(), await self.url()
        action, schema = await self.tool(cls, url)
        text = (load_object(c.observation, f"{KEY}.observation") if c.observation is not None
                else observation_text)
        session, first = await self.reset(cls, url, dict(task))
        try:
            turn_rewards: dict[int, float] = {}
            rewards: list[float] = []
            state = {"done": bool(first.done), "errors": 0}

            async def call_tool(turn: int, name: str, arguments: str) -> str:
                from pydantic import ValidationError

                try:
                    if name != "step":
                        raise ValueError(f"Tool {name} not found.")
                    args = parse_arguments(arguments)
                    act = action(**args) if action is not None else args
                except (ValueError, TypeError, ValidationError) as e:  # the model's own mistake
                    state["errors"] += 1
                    return str({"error": str(e)})
                try:
                    result = await session.step(act)
                except RuntimeError as e:
                    if "VALIDATION_ERROR" not in str(e):
                        raise
                    state["errors"] += 1
                    return str({"error": str(e)})
                reward = step_reward(result.reward, f"the step of model call {turn}")
                if reward is not None:
                    turn_rewards[turn] = turn_rewards.get(turn, 0.0) + reward
                    rewards.append(reward)
                state["done"] = state["done"] or bool(result.done)
                return str(text(result.observation))

            messages = prompt_messages(task, c.system_prompt, str(text(first.observation)))
            if not state["done"]:
                await tool_loop(client, messages, [schema], call_tool, c.max_turns,
                                ended=lambda: state["done"])
        except asyncio.CancelledError:  # timed out: a hung server would hold the close handshake
            await _close(session, wait=False)
            raise
        except BaseException:
            await _close(session, wait=False)
            raise
        await _close(session, wait=True)
        return {"reward": float(sum(rewards)), "turn_rewards": turn_rewards,
                "metrics": {TOOL_ERRORS: state["errors"]}}

    def close(self) -> None:
        """Stop the app server this process started."""
        c: OpenEnvConfig = self.config
        if c.app is None:
            return
        with _SERVERS_LOCK:
            server = _SERVERS.get(c.app)
            if server is not None and server.pid == os.getpid():
                del _SERVERS[c.app]
                server.stop()


_CLOSING: set = set()  # closes left running (a reference keeps each task alive)


async def _close(session: Any, *, wait: bool) -> None:
    """Close the session: awaited (bounded) at a normal end, else left to finish on its own."""
    task = asyncio.ensure_future(_disconnect(session))
    _CLOSING.add(task)
    task.add_done_callback(lambda t: (_CLOSING.discard(t), t.cancelled() or t.exception()))
    if wait:
        await asyncio.wait_for(asyncio.shield(task), 10)


async def _disconnect(session: Any) -> None:
    """End the server's session: the "close" message EnvClient.close() sends, then the server's
    own closing of the WebSocket waited for (2 s at most) before the client's. (EnvClient.close()
    closes at once, and openenv's server logs an ASGI exception with its traceback whenever the
    client's close comes first.)"""
    ws = getattr(session, "_ws", None)
    if ws is None or getattr(session, "_provider", None) is not None:
        await session.close()
        return
    session._ws = None
    try:
        await ws.send(json.dumps({"type": "close"}))
        await asyncio.wait_for(ws.wait_closed(), 2)
    except Exception:  # gone already, or no answer: closed below all the same
        pass
    finally:
        await ws.close()
