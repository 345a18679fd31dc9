"""Number guessing: the agent guesses a hidden number in 1..high; the environment answers
"higher" or "lower". Reward 1 if found within `max_turns` guesses, else 0.

A random guesser that ignores the feedback scores 1 - (1 - 1/high)^max_turns (0.33 for 8 and 3);
binary search scores 0.875. The agent is an ordinary `openai` SDK program: tracetrain only hands it a
base URL and a key.

`slow_every: k` with `slow_s: s` (task_args): every k-th task of a step answers each guess after
s seconds (an environment that takes time, as tests or tools do): rollouts of very uneven length,
for bench/bench_continuous.py.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from openai import AsyncOpenAI

SYSTEM = "Guess my number from 1 to {high}."
FIRST = "Guess."


def tasks(n: int, *, seed: int, high: int = 8, max_turns: int = 3, slow_every: int = 0,
          slow_s: float = 0.0, check_reward: float = 0.0, **_: Any) -> list[dict]:
    """`n` tasks with hidden numbers drawn uniformly from 1..high (every `slow_every`-th answered
    after `slow_s` seconds: module docstring; `check_reward`: checked_agent's checker verdicts
    get turn rewards)."""
    rng = random.Random(seed)
    return [{"target": rng.randint(1, high), "high": high, "max_turns": max_turns,
             **({"delay_s": slow_s} if slow_every and j % slow_every == 0 else {}),
             **({"check_reward": check_reward} if check_reward else {})} for j in range(n)]


def feedback(guess_text: str, target: int) -> tuple[str | None, float | None]:
    """(reply to the agent, reward when the game is over)."""
    text = guess_text.strip()
    if not text.isdigit():
        return None, 0.0  # not a number: the game ends, reward 0
    guess = int(text)
    if guess == target:
        return None, 1.0
    return ("higher" if guess < target else "lower"), None


def chat_prompt(high: int, history: list[tuple[str, str]]) -> list[dict]:
    """The whole conversation so far: each turn's prompt extends the previous one."""
    messages = [{"role": "system", "content": SYSTEM.format(high=high)}, {"role": "user", "content": FIRST}]
    for text, reply in history:
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": reply}]
    return messages


async def play(task: dict, client: dict, prompt) -> float:
    """One game through the gateway; `prompt(high, history)` builds each call's messages.
    `client` holds base_url, api_key, model and sampling, and an `http_client` shared by the run's
    agents (building a new one costs tens of ms of CPU)."""
    openai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                         http_client=client.get("http_client"))
    history: list[tuple[str, str]] = []
    for turn in range(task["max_turns"]):
        out = await openai.chat.completions.create(
            model=client["model"],
            messages=prompt(task["high"], history),
            temperature=client.get("temperature", 1.0),
            top_p=client.get("top_p", 1.0),
            max_tokens=client.get("max_tokens", 4),
            seed=None if client.get("seed") is None else client["seed"] + turn,
        )
        text = out.choices[0].message.content or ""
        if task.get("delay_s"):  # the environment takes its time to answer
            await asyncio.sleep(task["delay_s"])
        reply, reward = feedback(text, task["target"])
        if reward is not None:
            return reward
        history.append((text, reply))
    return 0.0


async def agent(task: dict, client: dict) -> float:
    """The default agent: keeps the whole chat."""
    return await play(task, client, chat_prompt)


def warm_start_transcripts(n: int, *, seed: int, high: int = 8, max_turns: int = 3,
                           **_: Any) -> list[list[dict]]:
    """Games of a random guesser that ignores the feedback: they teach the format, not the skill."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(1, high)
        messages = [{"role": "system", "content": SYSTEM.format(high=high)},
                    {"role": "user", "content": FIRST}]
        for _ in range(max_turns):
            guess = str(rng.randint(1, high))
            messages.append({"role": "assistant", "content": guess})
            reply, reward = feedback(guess, target)
            if reward is not None:
                break
            messages.append({"role": "user", "content": reply})
        out.append(messages)
    return out


# --- The context-rewriting variant: the agent summarises the game instead of keeping the chat. ---
# Each call sends [system, user: "Tried: 4 higher, 6 lower. Guess."]: the new prompt does not
# extend the previous context, so every turn after the first breaks the prefix (a context_rewrite)
# and a rollout spans several rows. The loss still gives each rollout the same mass.


def summary_prompt(high: int, history: list[tuple[str, str]]) -> list[dict]:
    tried = ", ".join(f"{g.strip()} {reply}" for g, reply in history)
    user = f"Tried: {tried}. {FIRST}" if history else FIRST
    return [{"role": "system", "content": SYSTEM.format(high=high)}, {"role": "user", "content": user}]


async def summarizing_agent(task: dict, client: dict) -> float:
    return await play(task, client, summary_prompt)


def summarizing_transcripts(n: int, *, seed: int, high: int = 8, max_turns: int = 3,
                            **_: Any) -> list[list[dict]]:
    """One-call transcripts in the summarising format, from random games (format only)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        target, history = rng.randint(1, high), []
        for _ in range(max_turns):
            guess = str(rng.randint(1, high))
            out.append(summary_prompt(high, history) + [{"role": "assistant", "content": guess}])
            reply, reward = feedback(guess, target)
            if reward is not None:
                break
            history.append((guess, reply))
    return out[:n]


# --- Two roles and rewards along the way: a guesser that trains, a checker that does not. -------
# Each guess goes to a checker first (a second role of the same program: its calls name the model
# "checker"; examples/guess/checker.yaml serves it with a frozen copy of the warm-started policy).
# A guess the checker rejects is sent back ("{g} is out") and costs the turn. Each guess also gets
# a turn reward as it is made: +STEP if it lies in the range the feedback so far leaves open, -STEP
# if the feedback already ruled it out (or it is not a number). The final reward is the game's.
CHECK = "Check."
STEP = 0.2


def check_prompt(lo: int, hi: int, guess: str) -> list[dict]:
    """The checker's chat: "Check." then "5 in 1-8?" (a format apart from the guesser's)."""
    return [{"role": "system", "content": CHECK},
            {"role": "user", "content": f"{guess.strip() or '?'} in {lo}-{hi}?"}]


def in_range(guess: str, lo: int, hi: int) -> bool:
    text = guess.strip()
    return text.isdigit() and lo <= int(text) <= hi


async def checked_agent(task: dict, client: dict) -> dict:
    """The guesser (model "guesser") and the checker (model "checker"); returns the game's reward
    and the turn rewards ({turn index: reward}, the gateway's index of each call): the guesser's,
    and with task["check_reward"] the checker's (examples/guess/two_policies.yaml)."""
    openai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                         http_client=client.get("http_client"))
    sampling = {"temperature": client.get("temperature", 1.0), "top_p": client.get("top_p", 1.0),
                "max_tokens": client.get("max_tokens", 4)}
    seed = client.get("seed")
    lo, hi = 1, task["high"]
    history: list[tuple[str, str]] = []
    turn_rewards: dict[int, float] = {}
    for turn in range(task["max_turns"]):
        out = await openai.chat.completions.create(
            model="guesser", messages=chat_prompt(task["high"], history),
            seed=None if seed is None else seed + 2 * turn, **sampling)
        text = out.choices[0].message.content or ""
        turn_rewards[out.model_extra["tracetrain"]["turn_index"]] = (
            STEP if in_range(text, lo, hi) else -STEP)
        check = await openai.chat.completions.create(
            model="checker", messages=check_prompt(lo, hi, text),
            seed=None if seed is None else seed + 2 * turn + 1, **sampling)
        verdict = (check.choices[0].message.content or "").strip()
        if task.get("check_reward"):  # the checker learns too: +c for the right verdict, -c else
            right = "yes" if in_range(text, lo, hi) else "no"
            turn_rewards[check.model_extra["tracetrain"]["turn_index"]] = (
                task["check_reward"] if verdict == right else -task["check_reward"])
        if verdict == "no":
            history.append((text, f"{text.strip()} is out"))
            continue
        reply, reward = feedback(text, task["target"])
        if reward is not None:
            return {"reward": reward, "turn_rewards": turn_rewards}
        guess = int(text.strip())
        lo, hi = (guess + 1, hi) if reply == "higher" else (lo, guess - 1)
        history.append((text, reply))
    return {"reward": 0.0, "turn_rewards": turn_rewards}


def checked_transcripts(n: int, *, seed: int, high: int = 8, max_turns: int = 3,
                        **_: Any) -> list[list[dict]]:
    """Both roles' formats, half each: random guessers' games (as warm_start_transcripts) and the
    checker answering yes / no correctly (some guesses not numbers). The checker has to compare
    numbers: greedy, it answers 63% right (always "no") after 150 steps of a third of the data,
    87% after 400 steps of half (a 200-question probe, 2026-12-03)."""
    rng = random.Random(seed)
    games = warm_start_transcripts(n - n // 2, seed=seed, high=high, max_turns=max_turns)
    checks = []
    for _ in range(n // 2):
        lo = rng.randint(1, high)
        hi = rng.randint(lo, high)
        guess = str(rng.randint(1, high)) if rng.random() < 0.9 else rng.choice(["x", "?", "12"])
        answer = "yes" if in_range(guess, lo, hi) else "no"
        checks.append(check_prompt(lo, hi, guess) + [{"role": "assistant", "content": answer}])
    mixed = games + checks
    rng.shuffle(mixed)
    return mixed
