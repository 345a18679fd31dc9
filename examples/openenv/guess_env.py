"""A small OpenEnv environment, written with openenv-core's own API and nothing of tracetrain's:
guess a secret number in 1..4; after each wrong guess the feedback says which numbers are left.

OpenEnv projects usually split this into models.py (Action, Observation), server/app.py (the
Environment and `create_app`) and client.py (the EnvClient); one file keeps the example short.

    reset(seed)      the secret is drawn from `seed`; the observation names the game and
                     asks for a guess
    step(guess)      reward 1 for the secret (done), else 0 and "G is wrong: the number is from L
                     to H." (the range the guesses so far leave); done after 4 guesses too

Serve it yourself (then point a config at it with `base_url`):
    .venv/bin/python examples/openenv/guess_env.py --port 8001
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

HIGH, MAX_GUESSES = 4, 4


class GuessAction(Action):
    """Guess the secret number."""

    guess: int = Field(..., description=f"a number from 1 to {HIGH}")


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session has its own instance

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.secret, self.low, self.high = 1, 1, HIGH

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.secret = random.Random(seed).randint(1, HIGH)
        self.low, self.high = 1, HIGH
        return GuessObservation(feedback=f"Game {seed}: I am thinking of a number from 1 to {HIGH}. "
                                         "Guess it with the step tool.", done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self.secret:
            return GuessObservation(feedback="Correct!", done=True, reward=1.0)
        if action.guess < self.secret:
            self.low = max(self.low, action.guess + 1)
        else:
            self.high = min(self.high, action.guess - 1)
        return GuessObservation(feedback=f"{action.guess} is wrong: the number is from {self.low} to "
                                         f"{self.high}.", reward=0.0,
                                done=self._state.step_count >= MAX_GUESSES)

    @property
    def state(self) -> State:
        return self._state


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    def _step_payload(self, action: GuessAction) -> dict:
        return {"guess": action.guess}

    def _parse_result(self, payload: dict) -> StepResult[GuessObservation]:
        obs = payload.get("observation", {})
        return StepResult(observation=GuessObservation(feedback=obs.get("feedback", ""),
                                                       done=payload.get("done", False),
                                                       reward=payload.get("reward")),
                          reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=64)


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8001)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port)
