"""TRL-style environment classes (`environment_factory`, as TRL 1.16's GRPOTrainer takes them),
played through the gateway by a built-in tool-calling agent; the loop OpenEnv reuses.

One rollout of a task `row` (a dict: one row of data.train):

    env      = factory()                                  one instance per rollout
    obs      = env.reset(**row)                           None, or a str appended to the prompt
    prompt   = [system: system_prompt] + row["prompt"]    a str (one user message) or messages;
               (no "prompt" column: one empty user message), obs added to its last message
    tools    = the public functions of type(env) but reset, get_reward, close, as
               transformers.utils.get_json_schema(bound method) (signature + Google docstring)
    turn t < max_turns:  reply_t = chat(messages, tools)  through the rollout's gateway endpoint;
               no tool call in it: the rollout ends; else each call runs env.<name>(**arguments)
               and its str(result) goes back as a tool message. A tool that raises answers the
               model str({"error": str(e)}) and the rollout goes on (TRL's convention: an
               environment tells the model "invalid move" by raising); an instance attribute
               `done` that is True after a turn's calls ends the rollout (a tracetrain extension)
    reward   = sum_f f(prompts=[prompt], completions=[completion], environments=[env], **{column:
               [value]}) over reward_funcs (None: f left out, TRL's nansum), + env.get_reward()
               when the class defines it (TRL 1.16: one more reward source of weight 1); with
               neither, the instance's `reward` attribute
    metrics  each source's term of that sum by name (the function's __name__, `get_reward`,
             `reward`), the rollout's `metrics` event: the step's env/<name> (run/step.py); with
             tools offered, also `tool_errors` (types.TOOL_ERRORS): the calls answered
             {"error": ...} (a tool that raised or whose arguments are not a JSON object, a
             tool that does not exist), the step's tools/errors
    finally  env.close() when it has one

Sync methods (the factory, reset, tools, sync reward functions, close) run in order on one daemon
thread per rollout, never on the event loop: a method that hangs holds only its own rollout,
which the rollout timeout ends (its thread is left to finish: Python cannot stop a thread). Async
methods are awaited. Anything but a tool's own exception (the factory, reset, a reward function,
a reward that is missing or not finite) raises: the runner makes it a failed rollout with the
traceback.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from tracetrain.agents.runner import post_to_rollout
from tracetrain.config import EnvironmentClassConfig
from tracetrain.envs.base import (
    EnvError,
    Environment,
    load_object,
    openai_for,
    register_env,
    sampling,
)
from tracetrain.types import TOOL_ERRORS

KEY = "env"
NOT_TOOLS = ("reset", "get_reward", "close")  # the lifecycle, never offered to the model
ToolCall = Callable[[int, str, str], Awaitable[str]]  # (turn, name, JSON arguments) -> result text


class InstanceThread:
    """The calls of one environment instance, in order, on one daemon thread (started on first
    use). `await call(fn, *args)` waits for fn's result off the event loop; a cancelled wait
    leaves fn running there."""

    def __init__(self, name: str = "tracetrain-env"):
        self.name = name
        self._queue: queue.SimpleQueue | None = None

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> asyncio.Future:
        """Queue fn(*args, **kwargs); the future (of the running loop) gets its result."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._run, args=(self._queue,), name=self.name, daemon=True).start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((fn, args, kwargs, loop, future))
        return future

    async def call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return await self.submit(fn, *args, **kwargs)

    def stop(self) -> None:
        """End the thread after the calls already queued."""
        if self._queue is not None:
            self._queue.put(None)

    @staticmethod
    def _run(calls: queue.SimpleQueue) -> None:
        while (item := calls.get()) is not None:
            fn, args, kwargs, loop, future = item
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as e:  # handed to the awaiting coroutine
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)


async def run_method(thread: InstanceThread, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """An environment's method: awaited when async, else on the instance's thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await thread.call(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def tool_methods(instance: Any) -> dict[str, Callable]:
    """name -> bound method: the public functions of the instance's class (TRL's rule: listed on
    the class, so properties are not evaluated) but the lifecycle ones (NOT_TOOLS)."""
    return {name: getattr(instance, name)
            for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS}


_SCHEMAS: dict[type, list[dict]] = {}


def tool_schemas(instance: Any) -> list[dict]:
    """The chat `tools` of the instance's class (cached per class): get_json_schema of each tool
    method; EnvError naming the method whose signature or docstring it cannot read."""
    cls = type(instance)
    if cls not in _SCHEMAS:
        from transformers.utils import get_json_schema

        schemas = []
        for name, method in tool_methods(instance).items():
            try:
                schemas.append(get_json_schema(method))
            except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
                raise EnvError(
                    f"config key '{KEY}.factory': the tool {cls.__name__}.{name} has no schema "
                    f"(every parameter needs a type hint and an `Args:` line in the docstring, as "
                    f"TRL requires): {e}") from None
        _SCHEMAS[cls] = schemas
    return _SCHEMAS[cls]


def prompt_messages(row: dict, system_prompt: str | None, observation: Any) -> list[dict]:
    """The first request's messages: row["prompt"] (a str: one user message; a list: messages;
    absent: one empty user message), the system message first when given, and `observation`
    (reset's return, a str) appended to the last message's text, as TRL does."""
    prompt = row.get("prompt", "")
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else [dict(m) for m in prompt])
    if not messages:
        messages = [{"role": "user", "content": ""}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if observation is not None:
        if not isinstance(observation, str):
            raise TypeError(f"reset() returned {type(observation).__name__}; the convention is "
                            "None or a str (appended to the prompt)")
        last = messages[-1]
        content = last.get("content") or ""
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": observation}]
        else:
            content = content + observation
        messages[-1] = {**last, "content": content}
    return messages


def result_text(result: Any) -> str:
    """A tool's result as the tool message's text: str(result), a list of text parts joined."""
    if isinstance(result, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in result):
        return "".join(str(p.get("text", "")) for p in result)
    return str(result)


async def tool_loop(client: dict, messages: list[dict], schemas: list[dict], call_tool: ToolCall,
                    max_turns: int, ended: Callable[[], bool] = lambda: False) -> list[dict]:
    """Up to `max_turns` model calls through the gateway, each one's tool calls answered by
    `call_tool(turn, name, arguments)` as tool messages; ends at a reply without tool calls or when
    `ended()` after a turn's calls. `messages` grows with the conversation as sent (the assistant
    message as the gateway returned it, so each request continues the previous one exactly).
    Returns the completion in TRL's form: the assistant messages (arguments parsed) and tool
    messages {"role": "tool", "name", "content"}."""
    api = openai_for(client)
    completion: list[dict] = []
    for turn in range(max_turns):
        out = await api.chat.completions.create(messages=messages, **sampling(client, turn),
                                                **({"tools": schemas} if schemas else {}))
        reply = out.choices[0].message
        calls = reply.tool_calls or []
        sent = {"role": "assistant", "content": reply.content}
        if calls:
            sent["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in calls]
        messages.append(sent)
        completion.append({"role": "assistant", "content": reply.content or "", **({"tool_calls": [
            {"type": "function", "function": {"name": c.function.name,
                                              "arguments": _arguments(c.function.arguments)}}
            for c in calls]} if calls else {})})
        if not calls:
            break
        for c in calls:
            text = await call_tool(turn, c.function.name, c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": text})
            completion.append({"role": "tool", "name": c.function.name, "content": text})
        if ended():
            break
    return completion


def _arguments(text: str | None) -> Any:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return text


def parse_arguments(text: str | None) -> dict:
    """A tool call's JSON arguments as keyword arguments; ValueError (told to the model) if not."""
    args = _arguments(text)
    if not isinstance(args, dict):
        raise ValueError(f"the arguments are not a JSON object: {text!r}")
    return args


def _drop(*args: Any, **kwargs: Any) -> None:
    """log_extra / log_metric: accepted from reward functions, not recorded."""


def finite(value: Any, what: str) -> float:
    """`value` as a finite float, or ValueError naming `what` (the rollout fails with it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} returned {value!r}: a reward must be a finite number")
    return float(value)


@register_env("environment_class")
class EnvironmentClassEnv(Environment):
    """env.kind environment_class: the module docstring's rollout, for each row of data.train."""

    @property
    def factory(self) -> Callable[[], Any]:
        c: EnvironmentClassConfig = self.config
        return load_object(c.factory, f"{KEY}.factory")

    @property
    def reward_funcs(self) -> list[Callable]:
        c: EnvironmentClassConfig = self.config
        return [load_object(spec, f"{KEY}.reward_funcs[{i}]") for i, spec in enumerate(c.reward_funcs)]

    async def agent(self, task: dict, client: dict) -> float:
        c: EnvironmentClassConfig = self.config
        factory, funcs = self.factory, self.reward_funcs
        thread = InstanceThread(f"tracetrain-env-{client.get('rollout_id', '')}")
        try:
            instance = await run_method(thread, factory)
        except BaseException:
            thread.stop()
            raise
        try:
            reward = await self.play(thread, instance, funcs, task, client, c)
        except asyncio.CancelledError:  # the rollout timed out: a call may hang on the thread
            close_later(thread, instance)
            raise
        except BaseException:
            try:
                await close(thread, instance)
            except Exception:  # the rollout's own error is the one reported
                pass
            raise
        await close(thread, instance)
        return reward

    async def play(self, thread: InstanceThread, instance: Any, funcs: list[Callable], task: dict,
                   client: dict, c: EnvironmentClassConfig) -> float:
        if not callable(getattr(instance, "reset", None)):
            raise EnvError(f"config key '{KEY}.factory': {type(instance).__name__} has "
                                   "no reset(**row) (TRL's environment_factory convention)")
        tools = tool_methods(instance)
        schemas = tool_schemas(instance)
        messages = prompt_messages(task, c.system_prompt, await run_method(thread, instance.reset, **task))
        prompt = [dict(m) for m in messages]
        errors = [0]  # calls answered {"error": ...}

        async def call_tool(turn: int, name: str, arguments: str) -> str:
            try:
                if name not in tools:
                    raise ValueError(f"Tool {name} not found.")
                result = await run_method(thread, tools[name], **parse_arguments(arguments))
            except Exception as e:  # TRL: the model is told, the rollout goes on
                result = {"error": str(e)}
                errors[0] += 1
            return result_text(result)

        completion = await tool_loop(client, messages, schemas, call_tool, c.max_turns,
                                     ended=lambda: getattr(instance, "done", False) is True)
        reward, parts = await self.score(thread, instance, funcs, task, prompt, completion)
        reported = {**parts, **({TOOL_ERRORS: errors[0]} if schemas else {})}
        await post_to_rollout(client, "events", [{"kind": "metrics", "payload": reported}])
        return reward

    async def score(self, thread: InstanceThread, instance: Any, funcs: list[Callable], row: dict,
                    prompt: list[dict], completion: list[dict]) -> tuple[float, dict[str, float]]:
        """The rollout's reward (module docstring) and each source's part of it, by name (a
        reward function's, `get_reward`, `reward`: the rollout's `metrics` event); ValueError
        naming the source of a bad one."""
        columns = {k: [v] for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        kwargs = {**columns, "trainer_state": None, "log_extra": _drop, "log_metric": _drop,
                  "environments": [instance]}
        parts: dict[str, float] = {}
        for i, fn in enumerate(funcs):
            name = getattr(fn, "__name__", repr(fn))
            out = await run_method(thread, fn, prompts=[prompt], completions=[completion], **kwargs)
            if not isinstance(out, (list, tuple)) or len(out) != 1:
                raise ValueError(f"reward function {name} returned {out!r}: one reward per "
                                 "completion (a list of 1) expected")
            if out[0] is not None:
                key = name if name not in parts else f"{name}_{i}"
                parts[key] = finite(out[0], f"reward function {name}")
        if callable(getattr(instance, "get_reward", None)):
            value = await run_method(thread, instance.get_reward)
            if value is not None:
                parts["get_reward"] = finite(value, f"{type(instance).__name__}.get_reward()")
        elif not funcs:
            if not hasattr(instance, "reward"):
                raise EnvError(
                    f"config key '{KEY}.reward_funcs': none given, and {type(instance).__name__} has "
                    "neither get_reward() nor a `reward` attribute: nothing scores the rollout")
            parts["reward"] = finite(instance.reward, f"{type(instance).__name__}.reward")
        if not parts:
            raise ValueError("every reward source returned None for this rollout")
        return float(sum(parts.values())), parts


async def close(thread: InstanceThread, instance: Any) -> None:
    """instance.close() when it has one (sync on its thread, or awaited); then the thread ends."""
    try:
        if callable(getattr(instance, "close", None)):
            await run_method(thread, instance.close)
    finally:
        thread.stop()


_LATER: set = set()  # closes left running after a cancelled rollout (a reference keeps each alive)


def close_later(thread: InstanceThread, instance: Any) -> None:
    """After a cancelled rollout: close() queued behind whatever call may hang on the thread (an
    async one scheduled), never awaited; its outcome is dropped."""
    fn = getattr(instance, "close", None)
    if callable(fn):
        pending = (asyncio.ensure_future(fn()) if inspect.iscoroutinefunction(fn)
                   else thread.submit(fn))
        _LATER.add(pending)
        pending.add_done_callback(lambda f: (_LATER.discard(f), f.cancelled() or f.exception()))
    thread.stop()
