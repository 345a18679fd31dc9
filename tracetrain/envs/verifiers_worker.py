"""verifiers environments, played: the classic `load_environment` API (`Classic`) and
`verifiers.v1` (`V1`). Imports nothing of tracetrain, and runs two ways:

    imported    tracetrain.envs.verifiers_env plays a classic environment in the run's process
                with `Classic` (it is async, and uses the runner's HTTP client);
    a script    `python verifiers_worker.py` under the interpreter of a venv that holds verifiers
                (scripts/install-verifiers.sh: verifiers 0.4 pins openai<3): the worker process,
                driven over JSON lines, one per line:

    stdin   {"op": "load", "env_id", "args", "api", "max_rows", "rows": bool}   (first, once)
            {"op": "run", "id": n, "task": row, "client": {base_url, api_key, model, temperature,
             top_p, max_tokens, seed}}
            {"op": "cancel", "id": n}                 (the rollout's timeout: its reply follows)
    stdout  {"op": "loaded", "api", "rows": [...] | null, "eval_rows": [...] | null, "seats"}
            {"op": "error", "error": traceback}       (the load failed; the worker exits)
            {"id": n, "result": {"reward", "metrics", "turn_rewards"}} | {"id": n, "error": text}

The worker plays many rollouts at once on one event loop (v1: inside the env's `serving()`,
held for the worker's life). It exits when its stdin closes (the run ended, or died); past a
grace period, or on SIGTERM, it kills every process it started first, so nothing outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import importlib
import itertools
import json
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any

RUN_SAMPLING = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "seed")
EXIT_GRACE_S = 10.0  # after stdin closes: the rollouts in flight are cancelled, then this long
_KEYS = itertools.count()
_REWARD_ERRORS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "tracetrain_vf_reward_errors", default=None)


class LoadError(Exception):
    """The environment cannot be used as configured (the message says why)."""


class RolloutFailed(Exception):
    """The environment failed this rollout (its own error, kept)."""


def jsonable(value: Any) -> Any:
    """`value` as JSON would carry it (what the run stores as the task)."""
    return json.loads(json.dumps(value, default=str))


def module_name(env_id: str) -> str:
    """The module verifiers' classic `load_environment(env_id)` imports."""
    return env_id.replace("-", "_").split("/")[-1]


def resolve_api(env_id: str, api: str) -> str:
    """`classic` or `v1`: `api` itself, or for `auto` what the environment's module is (a
    `load_environment` function: classic; else a v1 taskset)."""
    if api != "auto":
        return api
    try:
        module = importlib.import_module(module_name(env_id))
    except ImportError:
        module = None  # a v1 id may name a module verifiers finds elsewhere (its own tasksets)
    if module is not None and callable(getattr(module, "load_environment", None)):
        return "classic"
    try:
        importlib.import_module("verifiers.v1")
    except ImportError:
        return "classic"
    return "v1"


def open_player(env_id: str, args: dict, api: str, max_rows: int | None) -> Classic | V1:
    try:
        importlib.import_module("verifiers")
    except ImportError as e:
        raise LoadError(f"no verifiers in {sys.executable} (pip install verifiers, or bash "
                        "scripts/install-verifiers.sh and python: .venv-verifiers/bin/python): "
                        f"{e}") from None
    api = resolve_api(env_id, api)
    return (Classic if api == "classic" else V1)(env_id, args, max_rows)


def _verifiers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verifiers")
    except PackageNotFoundError:
        return "?"


class _RewardErrors(logging.Handler):
    """A classic rubric logs a reward function that raised and scores it 0; this hears that
    (on the rollout whose context logged it), so the rollout fails instead."""

    def emit(self, record: logging.LogRecord) -> None:
        errors = _REWARD_ERRORS.get()
        if errors is not None and record.levelno >= logging.ERROR:
            errors.append(record.getMessage())


class Classic:
    """A classic verifiers environment: `verifiers.load_environment(env_id, **args)`; each rollout
    is its own `rollout`, scored by its rubric's `score_rollout`, as verifiers' `run_rollout`
    does."""

    api = "classic"
    _client_class = None

    def __init__(self, env_id: str, args: dict, max_rows: int | None):
        import verifiers as vf

        load = getattr(vf, "load_environment", None)  # 0.4 has none
        if load is None:
            raise LoadError(f"verifiers {_verifiers_version()} has no classic API "
                            "(load_environment): use verifiers<0.4, or api: v1")
        try:
            self.env = load(env_id, **args)
        except Exception as e:
            raise LoadError(f"verifiers.load_environment({env_id!r}, **{args!r}) failed: "
                            f"{type(e).__name__}: {e}") from e
        if getattr(self.env, "requires_group_rollouts", False):
            raise LoadError(f"{env_id!r}: its rubric scores the rollouts of a group together "
                            "(group reward functions); tracetrain scores each rollout on its own")
        self.max_rows = max_rows
        self.seats: list[str] = []
        logging.getLogger("verifiers").addHandler(_RewardErrors())

    def dataset(self, eval: bool = False) -> Any:
        """Its dataset (eval: its eval_dataset), formatted by verifiers (prompt, example_id);
        None when it has none."""
        build = getattr(self.env, "build_eval_dataset" if eval else "build_dataset", None)
        ds = build() if build is not None else getattr(self.env, "eval_dataset" if eval else "dataset")
        if ds is None:
            return None
        if self.max_rows is not None and len(ds) > self.max_rows:
            ds = ds.select(range(self.max_rows))
        return ds

    @staticmethod
    def row(ds: Any, i: int) -> dict:
        return jsonable(dict(ds[i]))

    def rows(self, eval: bool = False) -> list[dict] | None:
        ds = self.dataset(eval)
        return None if ds is None else [self.row(ds, i) for i in range(len(ds))]

    def client(self, oai: Any, seed: int | None) -> Any:
        """verifiers' OpenAI chat client around `oai`; each call's seed is `seed` + its number in
        the rollout (as tracetrain's own agents do)."""
        cls = type(self)._client_class
        if cls is None:
            from verifiers.clients import OpenAIChatCompletionsClient

            class Calls(OpenAIChatCompletionsClient):
                seed: int | None = None
                calls = 0

                async def get_native_response(self, prompt, model, sampling_args, tools=None, **kw):
                    if self.seed is not None:
                        sampling_args = {**sampling_args, "seed": self.seed + self.calls}
                    self.calls += 1
                    return await super().get_native_response(prompt, model, sampling_args, tools, **kw)

            cls = type(self)._client_class = Calls
        out = cls(oai)
        out.seed = seed
        return out

    async def play(self, task: dict, client: dict, http_client: Any = None) -> dict:
        from openai import AsyncOpenAI

        oai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                          http_client=http_client)
        sampling = copy.deepcopy(getattr(self.env, "sampling_args", None) or {})
        sampling.update({k: client[k] for k in ("temperature", "top_p", "max_tokens")
                         if client.get(k) is not None})
        errors: list[str] = []
        token = _REWARD_ERRORS.set(errors)
        state = None
        try:
            state = await self.env.rollout(task, self.client(oai, client.get("seed")),
                                           client["model"], sampling)
            error = state.get("error")
            if error is not None:
                raise RolloutFailed(f"the environment's rollout failed: {type(error).__name__}: "
                                    f"{error}") from error
            if getattr(self.env, "score_rollouts", True):
                await self.env.rubric.score_rollout(state)
            else:
                await self.env.rubric.dummy_score_rollout(state)
        finally:
            _REWARD_ERRORS.reset(token)
            if state is not None and hasattr(self.env.rubric, "cleanup"):
                await self.env.rubric.cleanup(state)
            if http_client is None:
                await oai.close()
        if errors:
            raise RolloutFailed("the rubric's reward function raised (verifiers would score it 0): "
                                + "; ".join(errors))
        steps = state.get("trajectory") or []
        return {
            "reward": state.get("reward"),
            "metrics": {k: float(v) for k, v in (state.get("metrics") or {}).items() if v is not None},
            "turn_rewards": {i: float(s["reward"]) for i, s in enumerate(steps)
                             if isinstance(s, dict) and s.get("reward") is not None},
        }

    @contextlib.asynccontextmanager
    async def serving(self):
        yield


class V1:
    """A `verifiers.v1` environment: the env of taskset `env_id` (`args`: its env config, as
    `vf-eval --env.*` sets it); each rollout is one episode (`Env.run_slot`) whose agents' model
    calls go to the rollout's gateway URL. Agents whose runtime is not given run as local
    subprocesses; with several agents, each names itself as the calls' `model` (its role)."""

    api = "v1"

    def __init__(self, env_id: str, args: dict, max_rows: int | None):
        try:
            from verifiers.v1.configs.agent import agent_config_fields
            from verifiers.v1.runtimes import SubprocessConfig
            from verifiers.v1.utils.loaders import load_environment, resolve_env_config
        except ImportError as e:
            raise LoadError(f"verifiers {_verifiers_version()} has no verifiers.v1: {e}") from None
        data = dict(args)
        data["taskset"] = {**(data.get("taskset") or {}), "id": env_id}
        try:
            config = resolve_env_config(data)
            seats = agent_config_fields(config)
            for name, spec in seats.items():
                update: dict[str, Any] = {}
                if "runtime" not in spec.model_fields_set:
                    update["runtime"] = SubprocessConfig()
                if len(seats) > 1 and spec.client is None:
                    update["model"] = name
                if spec.sampling is not None:  # the run's sampling wins (its logprobs assume it)
                    own = spec.sampling.model_dump(exclude_unset=True)
                    update["sampling"] = type(spec.sampling).model_validate(
                        {k: v for k, v in own.items() if k not in RUN_SAMPLING})
                if update:
                    setattr(config, name, spec.model_copy(update=update))
            self.env = load_environment(config)
        except Exception as e:
            raise LoadError(f"verifiers.v1 env of taskset {env_id!r} with {args!r} failed to load: "
                            f"{type(e).__name__}: {e}") from e
        self.seats = list(seats)
        self.task_cls = type(self.env.taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        self.max_rows = max_rows

    def rows(self, eval: bool = False) -> list[dict] | None:
        if eval:
            return None  # a taskset has no held-out split of its own: data.eval_fraction
        taskset = self.env.taskset
        if self.max_rows is not None:
            taskset = taskset.take(self.max_rows)
        elif not taskset.bounded:
            raise LoadError(f"{type(taskset).__name__} is infinite: give max_rows")
        return [t.data.model_dump(mode="json", exclude_defaults=True) for t in taskset]

    @contextlib.asynccontextmanager
    async def serving(self):
        async with self.env.serving():
            yield

    async def play(self, task: dict, client: dict, http_client: Any = None) -> dict:
        from verifiers.v1 import EvalClientConfig, ModelContext, SamplingConfig

        # The key travels as verifiers reads it, an environment variable: one per rollout (its
        # name says API_KEY, so verifiers keeps it from the harness programs).
        var = f"TRACETRAIN_VF_API_KEY_{os.getpid()}_{next(_KEYS)}"
        os.environ[var] = client["api_key"]
        endpoint = EvalClientConfig(base_url=client["base_url"], api_key_var=var)
        sampling = {k: client[k] for k in RUN_SAMPLING if client.get(k) is not None}
        ctx = ModelContext(model=client["model"], client=endpoint, sampling=SamplingConfig(**sampling))
        try:
            (slot,) = self.env.slots(self.task_cls(self.data_cls.model_validate(task),
                                                   self.env.config.taskset.task))
            episode = await self.env.run_slot(slot, ctx)
        finally:
            os.environ.pop(var, None)
            await self._forget(endpoint)
        return self.result(episode)

    async def _forget(self, endpoint: Any) -> None:
        """Close the interception's client for this rollout's endpoint: verifiers keeps one per
        endpoint for the server's life, and each rollout has its own URL."""
        interception = getattr(self.env, "_interception", None)
        key = endpoint.model_dump_json()
        for server in getattr(interception, "servers", [interception]):
            client = getattr(server, "clients", {}).pop(key, None)
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()

    def result(self, episode: Any) -> dict:
        if not self.env.complete(episode):
            errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
            text = "\n".join(f"{e.type}: {e.message}" + (f"\n{e.traceback}" if e.traceback else "")
                             for e in errors) or "no error recorded"
            raise RolloutFailed(f"the episode failed:\n{text}")
        scored = [t for t in episode.traces if t.agent.trainable] or list(episode.traces)
        many = len(self.seats) > 1
        values: dict[str, list[float]] = {}
        for t in episode.traces:
            prefix = f"{t.agent.name}/" if many else ""
            named = {**{f"reward/{k}": r.score for k, r in t.rewards.items() if r is not None},
                     **{k: v for k, v in t.metrics.items() if v is not None}}
            if many:
                named["reward"] = t.reward
            for k, v in named.items():
                values.setdefault(prefix + k, []).append(float(v))
        return {"reward": sum(t.reward for t in scored) / len(scored),
                "metrics": {k: sum(v) / len(v) for k, v in values.items()}, "turn_rewards": {}}


# --- the worker process ------------------------------------------------------------------------


def kill_descendants() -> None:
    """SIGKILL every process below this one (the harness programs verifiers started, each in
    its own session): read from /proc; elsewhere nothing."""
    children: dict[int, list[int]] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    todo, found = [os.getpid()], []
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _die(*_: Any) -> None:
    kill_descendants()
    os._exit(1)


async def serve(out: Any) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[dict | None] = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin.buffer:
            if line.strip():
                loop.call_soon_threadsafe(inbox.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(inbox.put_nowait, None)  # the run closed us: go, within grace
        timer = threading.Timer(EXIT_GRACE_S, _die)  # daemon: a clean exit does not wait for it
        timer.daemon = True
        timer.start()

    def send(msg: dict) -> None:
        out.write(json.dumps(msg).encode() + b"\n")
        out.flush()

    threading.Thread(target=read, daemon=True).start()
    load = await inbox.get()
    if load is None:
        return
    try:
        player = open_player(load["env_id"], load.get("args") or {}, load.get("api", "auto"),
                             load.get("max_rows"))
        rows = player.rows() if load.get("rows") else None
        eval_rows = player.rows(eval=True) if load.get("rows") else None
    except Exception as e:  # the headline first, then where it came from
        send({"op": "error", "error": str(e) if isinstance(e, LoadError) else
              f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        return
    running: dict[int, asyncio.Task] = {}

    async def run(rid: int, task: dict, client: dict) -> None:
        try:
            send({"id": rid, "result": await player.play(task, client)})
        except asyncio.CancelledError:
            send({"id": rid, "error": "cancelled", "cancelled": True})
        except Exception as e:
            send({"id": rid, "error": str(e) if isinstance(e, RolloutFailed) else traceback.format_exc()})
        finally:
            running.pop(rid, None)

    async with player.serving():
        send({"op": "loaded", "api": player.api, "rows": rows, "eval_rows": eval_rows,
              "seats": player.seats})
        while (msg := await inbox.get()) is not None:
            if msg.get("op") == "run":
                running[msg["id"]] = asyncio.create_task(run(msg["id"], msg["task"], msg["client"]))
            elif msg.get("op") == "cancel" and msg.get("id") in running:
                running[msg["id"]].cancel()
        for t in list(running.values()):
            t.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)  # tracetrain/envs/ holds modules named like packages (openenv.py)
    out = os.fdopen(os.dup(1), "wb")  # the protocol's; everything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGTERM, _die)
    asyncio.run(serve(out))


if __name__ == "__main__":
    main()
