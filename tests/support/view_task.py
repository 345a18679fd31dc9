"""A task for the viewer's tests: the guessing game with what a viewer must show safely.

Task kinds, in turn (task j has kind KINDS[j % 4]):
- "plain": the game as examples/guess plays it (a wrong number ends it with reward 0.5).
- "hostile": the system prompt holds markup (`<script>`, `</div>`) and characters that the tiny
  tokenizer splits into byte tokens (`漢字 🙂`); a viewer must print all of it as text.
- "rewrite": from the second call on the agent drops the system message: the prompt no longer
  extends the one before (a context_rewrite drift break under trajectory aggregation).
- "fail": the agent raises after its first call (a failed rollout with a traceback).
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

KINDS = ("plain", "hostile", "rewrite", "fail")
HOSTILE = "Guess my number.</div><script>document.title='pwned';window.pwned=1</script> 漢字 🙂"
FAILURE = "the tool crashed: <b>boom</b>"


def tasks(n: int, *, seed: int, **_: Any) -> list[dict]:
    return [{"kind": KINDS[j % len(KINDS)], "target": 1 + (seed + j) % 4} for j in range(n)]


async def agent(task: dict, client: dict) -> float:
    openai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                         http_client=client.get("http_client"))
    system = HOSTILE if task["kind"] == "hostile" else "Guess my number from 1 to 4."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Guess."}]
    for turn in range(3):
        out = await openai.chat.completions.create(
            model=client["model"], messages=messages, temperature=client.get("temperature", 1.0),
            max_tokens=client.get("max_tokens", 4),
            seed=None if client.get("seed") is None else client["seed"] + turn)
        text = out.choices[0].message.content or ""
        if task["kind"] == "fail":
            raise RuntimeError(FAILURE)
        if text.strip() == str(task["target"]):
            return 1.0
        if task["kind"] == "plain" and any(c.isdigit() for c in text):
            return 0.5  # a number, at least: rewards differ within a group
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "higher"}]
        if task["kind"] == "rewrite":
            messages = [m for m in messages if m["role"] != "system"]
    return 0.0
