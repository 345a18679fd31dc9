"""Arithmetic with a calculator tool, for a real pretrained chat model (SmolLM2-135M-Instruct).

The agent asks a question (after one worked example, as earlier turns of the chat); the model
may answer `CALC: <expression>` to use the calculator (the agent evaluates it and sends back the
result) or give its answer. Reward 1 if the correct number appears in the model's final reply
within `max_turns` calls, else 0. An ordinary `openai` program.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from openai import AsyncOpenAI

SYSTEM = (
    "You are a careful assistant with a calculator. To use it, reply exactly `CALC: <expression>`, "
    "for example `CALC: 12 * 7`. When you know the result, reply with the number only."
)
# One worked exchange, sent before the question as earlier turns of the chat. Told only in the
# system prompt, the untrained model answers 0 of 48 sampled questions with `CALC:`; shown this,
# about 2 in 3 (mostly with a wrong expression): there are calls for RL to improve on.
EXAMPLE = [
    {"role": "user", "content": "What is 17 * 23?"},
    {"role": "assistant", "content": "CALC: 17 * 23"},
    {"role": "user", "content": "Calculator: 391"},
    {"role": "assistant", "content": "391"},
]
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def tasks(n: int, *, seed: int, max_operand: int = 50, max_turns: int = 3, example: bool = True,
          **_: Any) -> list[dict]:
    """`example` false: the agent sends no worked example (harder: the untrained model then
    almost never calls the calculator)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(2, max_operand), rng.randint(2, max_operand), rng.choice(sorted(OPS))
        out.append({"question": f"What is {a} {op} {b}?", "answer": OPS[op](a, b), "max_turns": max_turns,
                    "example": example})
    return out


def calculate(expression: str) -> str:
    """Evaluate + - * over integers (no names, no calls); an error message otherwise."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in AST_OPS:
            return AST_OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("only integers with + - * are supported")

    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as e:
        return f"error: {e}"


def numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


async def agent(task: dict, client: dict) -> float:
    openai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                         http_client=client.get("http_client"))
    shown = EXAMPLE if task.get("example", True) else []
    messages = [{"role": "system", "content": SYSTEM}, *shown, {"role": "user", "content": task["question"]}]
    for turn in range(task["max_turns"]):
        out = await openai.chat.completions.create(
            model=client["model"], messages=messages,
            temperature=client.get("temperature", 1.0), top_p=client.get("top_p", 1.0),
            max_tokens=client.get("max_tokens", 24),
            seed=None if client.get("seed") is None else client["seed"] + turn,
        )
        text = out.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        call = re.search(r"CALC:\s*([-+*\d\s()]+)", text)
        if call and turn + 1 < task["max_turns"]:
            messages.append({"role": "user", "content": f"Calculator: {calculate(call.group(1))}"})
            continue
        return 1.0 if task["answer"] in numbers(text) else 0.0
    return 0.0
