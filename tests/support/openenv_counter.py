"""An OpenEnv environment written with openenv-core's own API, for tests/envs/test_openenv.py: a
counter to bring to a target, served by `create_app` (the app below, or this file run as a
server: `python openenv_counter.py` binds 127.0.0.1 at a free port and prints URL=<its url>).

reset(seed, mode): the target is 6 + seed % 5 (more than one step of at most 5 away). step(add): the
total grows by `add`; the step's reward is -|target - total| / 10, done once the total reaches the
target. `mode` makes the environment misbehave: "raise" (step raises on the server), "hang" (step
blocks until RELEASE is set or 20 s pass).
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

RELEASE = threading.Event()  # set by the test at its end: a hung step returns


class CounterAction(Action):
    """Add a number to the counter."""

    add: int = Field(..., description="the number to add")


class CounterObservation(Observation):
    total: int = 0
    target: int = 0


class CounterEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.total, self.target, self.mode = 0, 0, "ok"

    def reset(self, seed: int | None = None, episode_id: str | None = None, mode: str = "ok",
              **kwargs: Any) -> CounterObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.total, self.target, self.mode = 0, 6 + (seed or 0) % 5, mode
        return CounterObservation(total=0, target=self.target, done=False, reward=None)

    def step(self, action: CounterAction, timeout_s: float | None = None,
             **kwargs: Any) -> CounterObservation:
        if self.mode == "raise":
            raise RuntimeError("the counter server broke in step")
        if self.mode == "hang":
            RELEASE.wait(20)
        self._state.step_count += 1
        self.total += action.add
        return CounterObservation(total=self.total, target=self.target,
                                  done=self.total >= self.target,
                                  reward=-abs(self.target - self.total) / 10)

    @property
    def state(self) -> State:
        return self._state


class CounterClient(EnvClient[CounterAction, CounterObservation, State]):
    def _step_payload(self, action: CounterAction) -> dict:
        return {"add": action.add}

    def _parse_result(self, payload: dict) -> StepResult[CounterObservation]:
        obs = payload.get("observation", {})
        return StepResult(
            observation=CounterObservation(total=obs.get("total", 0), target=obs.get("target", 0),
                                           done=payload.get("done", False), reward=payload.get("reward")),
            reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


app = create_app(CounterEnvironment, CounterAction, CounterObservation, env_name="counter",
                 max_concurrent_envs=32)


if __name__ == "__main__":
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0))
    sock.listen(128)
    print(f"URL=http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
