"""verifiers environments as task sources, played as they are (docs/environments.md):

    classic (verifiers 0.3, `load_environment`)   in the run's process: rows are its `dataset`
        (`eval_dataset`: the held-out rows), each rollout its own `rollout` with verifiers' OpenAI
        client on the rollout's gateway URL, scored by its rubric's `score_rollout`;
    verifiers.v1 (0.4: Taskset, Harness, Env)     in a worker process (verifiers_worker.py) under
        `python` (its own venv: 0.4 pins openai<3), or this interpreter: rows are its taskset's
        task data, each rollout one episode whose agents' model calls go to the gateway URL
        (several agents: each names itself as the calls' model, so each is a role).

    reward          the rubric's reward (classic) / the mean reward of the episode's trainable
                    agents' traces (v1)
    turn rewards    classic trajectory steps given a reward (step i: the rollout's turn i)
    metrics         the rubric's functions (classic) / each trace's named rewards and metrics
                    (v1), posted as the rollout's event of kind `metrics`

A worker serves the rollouts of its process at once. An environment error fails its rollout with
the error kept; at rollout.timeout_s the rollout is cancelled there, and a worker that does not
let go of it within CANCEL_GRACE_S is killed with everything it started (the next rollout starts
another). Workers end with their process (their stdin closes).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import Any

from tracetrain.agents.dataset import TaskRows
from tracetrain.config import VerifiersConfig
from tracetrain.envs.base import EnvError, Environment, TaskRowsOf, need, register_env

KEY = "env"
WORKER = Path(__file__).with_name("verifiers_worker.py")
CANCEL_GRACE_S = 10.0  # a cancelled rollout must be let go of this fast, or its worker is killed
LOAD_TIMEOUT_S = 600.0  # a worker's load (import verifiers, the env, its dataset) at most
CLIENT_KEYS = ("base_url", "api_key", "model", "temperature", "top_p", "max_tokens", "seed")
log = logging.getLogger("tracetrain.envs.verifiers")


def dataset_rows(dataset: Any, name: str) -> TaskRowsOf:
    """A classic environment's (HF) dataset as rows: row i is its row i, as JSON carries it."""
    from tracetrain.envs.verifiers_worker import Classic

    return TaskRowsOf(len(dataset), lambda i: Classic.row(dataset, i), name)


def list_rows(rows: list[dict], name: str) -> TaskRowsOf:
    return TaskRowsOf(len(rows), rows.__getitem__, name)


class WorkerDied(RuntimeError):
    pass


def settle(fut: concurrent.futures.Future, result: Any = None, error: BaseException | None = None):
    """Give `fut` its result (or error) unless it has one, or was cancelled meanwhile."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class Worker:
    """One worker process (verifiers_worker.py under `python`), its replies read by a thread: a
    request is a concurrent future, awaited from any event loop or waited for in sync code."""

    live: weakref.WeakSet[Worker] = weakref.WeakSet()

    def __init__(self, python: str, paths: list[str], load: dict):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [*paths, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
        bin_dir = Path(python).parent
        if (bin_dir.parent / "pyvenv.cfg").exists():  # as if its venv were activated (its `uv`)
            env["PATH"] = os.pathsep.join([str(bin_dir), *filter(None, [os.environ.get("PATH")])])
        self.proc = subprocess.Popen(
            [python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, env=env)
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.cancelling: set[int] = set()
        self.stderr: deque[str] = deque(maxlen=60)
        self.dead: str | None = None
        self.loaded: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()
        self._send({"op": "load", **load})
        Worker.live.add(self)

    def _send(self, msg: dict) -> None:
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # it died: the reader fails what is pending

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "id" not in msg:
                settle(self.loaded, msg)
                continue
            with self.lock:
                fut = self.pending.pop(msg["id"], None)
                self.cancelling.discard(msg["id"])
            if fut is not None:
                settle(fut, msg)
        self.proc.wait()
        why = self.dead or f"the verifiers worker exited with status {self.proc.returncode}"
        self.dead = why
        tail = "".join(self.stderr)[-4000:]
        error = WorkerDied(f"{why}; its last output:\n{tail}" if tail else why)
        settle(self.loaded, error=error)
        with self.lock:
            pending, self.pending = self.pending, {}
        for fut in pending.values():
            settle(fut, error=error)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            text = line.decode(errors="replace")
            self.stderr.append(text)
            log.debug("verifiers worker %d: %s", self.proc.pid, text.rstrip())

    async def run(self, task: Any, client: dict) -> dict:
        rid = next(self.ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.pending[rid] = fut
        self._send({"op": "run", "id": rid, "task": task, "client": client})
        try:
            reply = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the rollout's timeout: the worker must let go of it
            with self.lock:
                self.cancelling.add(rid)
            self._send({"op": "cancel", "id": rid})
            timer = threading.Timer(CANCEL_GRACE_S, self._check_cancelled, (rid,))
            timer.daemon = True
            timer.start()
            raise
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def _check_cancelled(self, rid: int) -> None:
        with self.lock:
            stuck = rid in self.cancelling
        if stuck:
            self.kill(f"the verifiers worker did not stop a timed-out rollout within "
                      f"{CANCEL_GRACE_S:g} s: killed")

    def kill(self, why: str) -> None:
        """SIGTERM (the worker kills what it started), then SIGKILL its process group."""
        self.dead = self.dead or why
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def close(self) -> None:
        """Close its stdin (it finishes, or is killed past its grace), then wait for it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(15.0)
        except subprocess.TimeoutExpired:
            self.kill("closed")


@atexit.register
def _close_workers() -> None:
    for w in list(Worker.live):
        w.close()


@register_env("verifiers")
class VerifiersEnv(Environment):
    """env.kind verifiers: the module docstring's rows and rollout."""

    def _search_path(self) -> None:
        c: VerifiersConfig = self.config
        for folder in reversed(c.path):
            if folder not in sys.path:
                sys.path.insert(0, folder)

    @functools.cached_property
    def in_process(self) -> bool:
        """Whether the environment is played in this process (a classic one, `python` null)."""
        c: VerifiersConfig = self.config
        if c.python is not None or c.api == "v1":
            return False
        need("verifiers", KEY)
        self._search_path()
        from tracetrain.envs.verifiers_worker import resolve_api

        return resolve_api(c.env_id, c.api) == "classic"

    @functools.cached_property
    def classic(self) -> Any:
        from tracetrain.envs.verifiers_worker import Classic, LoadError

        c: VerifiersConfig = self.config
        try:
            return Classic(c.env_id, c.args, c.max_rows)
        except LoadError as e:
            raise EnvError(f"config key '{KEY}': {e}") from None

    @functools.cached_property
    def python(self) -> str:
        c: VerifiersConfig = self.config
        python = c.python or sys.executable
        found = python if "/" in python else shutil.which(python)
        if found is None or not Path(found).exists():
            raise EnvError(f"config key '{KEY}.python': no interpreter {python!r} (bash "
                                   "scripts/install-verifiers.sh makes .venv-verifiers/bin/python)")
        return found

    _worker: Worker | None = None
    _loaded: dict | None = None

    def _start(self, rows: bool) -> Worker:
        """The live worker, started (loading the environment) when there is none."""
        with _START:
            w = self._worker
            if w is None or w.dead is not None:
                w = self._worker = self._new_worker(rows)
            return w

    def _new_worker(self, rows: bool) -> Worker:
        c: VerifiersConfig = self.config
        return Worker(self.python, c.path, {"env_id": c.env_id, "args": c.args, "api": c.api,
                                            "max_rows": c.max_rows, "rows": rows})

    def _check_loaded(self, msg: dict) -> dict:
        if msg.get("op") != "loaded":
            raise EnvError(f"config key '{KEY}': {msg.get('error', msg)}")
        return msg

    def _wait_loaded(self, w: Worker) -> dict:
        try:
            return self._check_loaded(w.loaded.result(LOAD_TIMEOUT_S))
        except concurrent.futures.TimeoutError:
            w.kill("load timed out")
            raise EnvError(f"config key '{KEY}': the verifiers worker did not load "
                                   f"{self.config.env_id!r} within {LOAD_TIMEOUT_S:g} s") from None
        except WorkerDied as e:
            raise EnvError(f"config key '{KEY}': {e}") from None

    def _load_rows(self) -> dict:
        """The worker's load reply with the rows (a worker an agent started has none: a second
        one, closed after, brings them)."""
        if self._loaded is None:
            msg = self._wait_loaded(self._start(rows=True))
            if msg.get("rows") is None:
                w = self._new_worker(rows=True)
                try:
                    msg = self._wait_loaded(w)
                finally:
                    w.close()
            self._loaded = msg
        return self._loaded

    def rows(self) -> TaskRows:
        c: VerifiersConfig = self.config
        name = f"verifiers {c.env_id}"
        if self.in_process:
            ds = self.classic.dataset()
            if ds is None:
                raise EnvError(f"config key '{KEY}': {c.env_id!r} has no dataset (only "
                                       "an eval_dataset): nothing to train on")
            return dataset_rows(ds, name)
        return list_rows(self._load_rows()["rows"], name)

    def eval_rows(self) -> TaskRows | None:
        c: VerifiersConfig = self.config
        if self.in_process:
            ds = self.classic.dataset(eval=True)
            return None if ds is None else dataset_rows(ds, f"verifiers {c.env_id} (eval_dataset)")
        rows = self._load_rows()["eval_rows"]
        return None if rows is None else list_rows(rows, f"verifiers {c.env_id} (eval_dataset)")

    async def agent(self, task: dict, client: dict) -> float | dict | None:
        if self.in_process:
            out = await self.classic.play(task, client, client.get("http_client"))
        else:
            w = self._start(rows=False)
            try:
                self._check_loaded(await asyncio.shield(asyncio.wrap_future(w.loaded)))
            except WorkerDied as e:
                raise EnvError(f"config key '{KEY}': {e}") from None
            out = await w.run(task, {k: client.get(k) for k in CLIENT_KEYS})
        if out.get("metrics"):
            await post_event(client, "metrics", out["metrics"])
        turn_rewards = {int(k): v for k, v in (out.get("turn_rewards") or {}).items()}
        return {"reward": out["reward"], "turn_rewards": turn_rewards} if turn_rewards else out["reward"]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None


_START = threading.Lock()


async def post_event(client: dict, kind: str, payload: Any) -> None:
    """Record `payload` as the rollout's event `kind` (GET /rollouts/{id}/events)."""
    from tracetrain.agents.runner import post_to_rollout

    await post_to_rollout(client, "events", [{"kind": kind, "payload": payload}])
