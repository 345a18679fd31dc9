"""examples/openenv: its expert against its environment (openenv-core's own Environment class,
in-process), the rule the config's comments state: the expert always finds 1, and 2 to 4
only in the games it does not get stuck in (about half in all), and guessing the lowest number the
feedback leaves finds every secret within the environment's 4 guesses (the room RL has above the
expert)."""

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


def play(policy, seed: int) -> tuple[int, float, int]:
    """(secret, reward sum, guesses) of `policy(messages) -> guess` in game `seed`, the messages
    as tracetrain's OpenEnv agent shows them (the opening, then each feedback as a tool result)."""
    env = ENV.GuessEnvironment()
    obs = env.reset(seed=seed)
    messages = [{"role": "user", "content": obs.feedback}]
    total, guesses = 0.0, 0
    while not obs.done:
        guess = policy(messages)
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "step", "arguments": json.dumps({"guess": guess})}}]})
        obs = env.step(ENV.GuessAction(guess=guess))
        messages.append({"role": "tool", "content": obs.feedback})
        total, guesses = total + obs.reward, guesses + 1
    return env.secret, total, guesses


def expert_guess(messages) -> int:
    reply = EXPERT.expert(messages, None)
    return json.loads(reply["tool_calls"][0]["function"]["arguments"])["guess"]


def lowest_left(messages) -> int:
    found = [EXPERT.LEFT.search(str(m["content"])) for m in messages if m["role"] == "tool"]
    return int(found[-1].group(1)) if found and found[-1] else 1


def test_the_expert_is_right_about_half_the_time_and_the_lowest_number_left_always():
    games = range(400)
    expert = [play(expert_guess, g) for g in games]
    stuck = [EXPERT.stuck(ENV.GuessEnvironment().reset(seed=g).feedback) for g in games]
    assert all(reward == (1.0 if secret == 1 or not st else 0.0)
               for (secret, reward, _), st in zip(expert, stuck, strict=True))
    # a game it lost, it was stuck in to the last guess
    assert all(n == ENV.MAX_GUESSES for (secret, reward, n) in expert if reward == 0)
    assert 0.4 < sum(r for _, r, _ in expert) / len(games) < 0.55
    assert 0.6 < sum(stuck) / len(games) < 0.8  # STUCK_PERCENT of the games
    best = [play(lowest_left, g) for g in games]
    assert all(reward == 1.0 and n == secret for secret, reward, n in best)
    assert {secret for secret, _, _ in best} == set(range(1, ENV.HIGH + 1))
