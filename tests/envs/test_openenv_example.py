"""examples/openenv: its expert against its environment (openenv-core's own Environment class,
in-process), the rule the config's comments state: the expert finds the secrets 1, 2 and 3 and
never 4, 5 or 6 (right half the time), and guessing the lowest number the feedback leaves finds
every secret within the environment's 6 guesses (the room RL has above the expert)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openenv"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"openenv_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (pydantic resolves the module's annotations by its name)
    spec.loader.exec_module(module)
    return module


ENV, EXPERT = load("guess_env"), load("expert")


def seed_of(secret: int) -> int:
    """A reset seed whose secret is `secret`."""
    env = ENV.GuessEnvironment()
    return next(s for s in range(1000) if (env.reset(seed=s), env.secret)[1] == secret)


def play(policy, secret: int) -> tuple[float, int]:
    """(reward sum, guesses) of `policy(messages) -> guess` on the secret, the messages as
    tracetrain's OpenEnv agent shows them (each observation's feedback as a tool result)."""
    env = ENV.GuessEnvironment()
    obs = env.reset(seed=seed_of(secret))
    messages = [{"role": "user", "content": obs.feedback}]
    total, guesses = 0.0, 0
    while not obs.done:
        guess = policy(messages)
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "step", "arguments": json.dumps({"guess": guess})}}]})
        obs = env.step(ENV.GuessAction(guess=guess))
        messages.append({"role": "tool", "content": obs.feedback})
        total, guesses = total + obs.reward, guesses + 1
    return total, guesses


def expert_guess(messages) -> int:
    reply = EXPERT.expert(messages, None)
    return json.loads(reply["tool_calls"][0]["function"]["arguments"])["guess"]


def lowest_left(messages) -> int:
    found = [EXPERT.LEFT.search(str(m["content"])) for m in messages if m["role"] == "tool"]
    return int(found[-1].group(1)) if found and found[-1] else 1


def test_the_expert_finds_half_the_secrets_and_the_lowest_number_left_finds_all():
    secrets = range(1, ENV.HIGH + 1)
    expert = [play(expert_guess, s) for s in secrets]
    assert [reward for reward, _ in expert] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert [n for _, n in expert] == [1, 2, 3, 6, 6, 6]  # stuck at 3 until the guesses run out
    best = [play(lowest_left, s) for s in secrets]
    assert best == [(1.0, s) for s in secrets]
