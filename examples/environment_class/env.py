"""A TRL-style environment class (TRL's `environment_factory` convention), used by tracetrain
as it is: nothing in this file knows about tracetrain.

Each rollout gets a fresh `ArithmeticEnv()`; `reset(**row)` receives the dataset row's columns
(`prompt`, `question`, `answer`); the public methods `calculate` and `submit` are the model's
tools (their type hints and Google-style docstrings are the tool schemas); `correct` is a reward
function in TRL's form, reading the environment instances.
"""

from __future__ import annotations

import ast
import operator

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only integers with + - * are allowed")


class ArithmeticEnv:
    def reset(self, question: str, answer: int, **row) -> str | None:
        """A new episode for one dataset row; what it returns is appended to the prompt."""
        self.answer, self.submitted, self.done = answer, None, False
        return None  # the row's `prompt` already asks the question

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: integers combined with +, - and *, e.g. "12 * 7"

        Returns:
            The value of the expression.
        """
        return str(_evaluate(ast.parse(expression, mode="eval")))  # a ValueError goes to the model

    def submit(self, answer: int) -> str:
        """Submit the final answer; this ends the episode.

        Args:
            answer: the answer to the question
        """
        self.submitted, self.done = answer, True
        return "submitted"


def correct(completions, environments, **kwargs) -> list[float]:
    """1 for a rollout whose submitted answer is right, else 0."""
    return [1.0 if env.submitted == env.answer else 0.0 for env in environments]
