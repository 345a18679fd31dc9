"""TRL-style environment classes for tests/envs/test_tools_env.py, written as TRL's
`environment_factory` takes them: reset(**row) returns text for the prompt, the public methods
(typed, with Google docstrings) are the model's tools, the reward functions read the instances.

The row's `mode` makes an environment misbehave: "raise" (reset raises), "hang" (the tool blocks
its thread until RELEASE is set or 30 s pass), "nan" (the reward function returns NaN).
"""

from __future__ import annotations

import threading

RELEASE = threading.Event()  # set by the test at its end: a hung tool returns
CLOSED: list[int] = []  # the totals of the instances closed, in this process


class Counter:
    """A counter to bring to the row's target with `add`."""

    def __init__(self):
        self.total = 0
        self.calls = 0

    def reset(self, target: int, mode: str = "ok", **row) -> str:
        self.target, self.mode, self.total, self.calls = target, mode, 0, 0
        if mode == "raise":
            raise RuntimeError("the counter environment broke in reset")
        return f" Reach {target}."

    def add(self, n: int) -> str:
        """Add a number to the counter.

        Args:
            n: the number to add
        """
        if self.mode == "hang":
            RELEASE.wait(30)
        self.calls += 1
        self.total += n
        return f"total {self.total}"

    def close(self) -> None:
        CLOSED.append(self.total)


def closeness(completions, environments, mode=None, **kwargs) -> list[float]:
    """-|target - total| / 10 per rollout (NaN for mode "nan")."""
    mode = mode or ["ok"] * len(environments)
    return [float("nan") if m == "nan" else -abs(env.target - env.total) / 10
            for env, m in zip(environments, mode, strict=True)]


def called(completions, **kwargs) -> list[float | None]:
    """0.1 when the completion holds a tool message; None (left out, as in TRL) otherwise."""
    return [0.1 if any(m["role"] == "tool" for m in c) else None for c in completions]


class Owned:
    """Owns its reward (TRL 1.16's get_reward) and says when it is done."""

    def reset(self, **row) -> None:
        self.steps, self.done = 0, False

    def poke(self) -> str:
        """Poke the environment once."""
        self.steps += 1
        self.done = True  # one poke ends the rollout
        return "poked"

    def get_reward(self) -> float:
        return float(self.steps)


class Undocumented:
    def reset(self, **row) -> None:
        pass

    def act(self, x):
        return x
