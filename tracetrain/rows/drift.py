"""Drift: why a turn's prompt does not start with the running context of its row, classified.

At the trajectory level a row grows while each new prompt starts with the row's running context
(previous prompt + previous response, as token ids). When it does not, the row is closed; this file
says why, from the ids alone (and the decoded text when a tokenizer is given):

    position p      = first index where running context and new prompt differ
                      (p = len(prompt) when the prompt is a strict prefix of the context)
    retokenization  : tokenizer given and decode(context) is a prefix of decode(prompt):
                      the text is unchanged, only its token ids differ
    assistant_rewrite: the first change lies inside an earlier model response of the context
                      (reasoning stripped by a chat template, a tool call re-serialized)
    context_rewrite : the first change lies in an earlier prompt/observation
                      (truncation, summary, a new system prompt)

"The first change" is token p without a tokenizer; with one, it is the context token holding the
first differing character of the decoded texts, so that a harmless retokenization earlier in the
context does not hide where the text was really changed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tracetrain.types import same_kind

RETOKENIZATION = "retokenization"
ASSISTANT_REWRITE = "assistant_rewrite"
CONTEXT_REWRITE = "context_rewrite"
DRIFT_KINDS = (RETOKENIZATION, ASSISTANT_REWRITE, CONTEXT_REWRITE)

SNIPPET_TOKENS = 8  # tokens shown on each side of the break position


@dataclass(frozen=True)
class DriftBreak:
    """One closed row: turn `turn_index` of `rollout_id` did not extend the running context.

    position: first differing token index between running context and the new prompt.
    recomputed_tokens: prompt tokens of the new row (as placed in the batch) that are forwarded
        again as context, with no gradient, because the row was closed.
    snippet: the context and the new prompt around `position` (decoded text with a tokenizer,
        ids without one).
    """

    rollout_id: str
    turn_index: int
    kind: str
    position: int
    recomputed_tokens: int
    snippet: str


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Smallest i with a[i] != b[i], or min(len(a), len(b)) when one is a prefix of the other.

    Bisects with slice comparisons (C speed), then scans the last short window.
    """
    a, b = same_kind(a, b)
    lo, hi = (
        0,
        min(len(a), len(b)),
    )  # invariant: a[:lo] == b[:lo]; a difference in [lo, hi) or hi == n
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    for i in range(lo, hi):
        if a[i] != b[i]:
            return i
    return hi


def break_position(
    prev_prompt: Sequence[int], prev_response: Sequence[int], prompt: Sequence[int]
) -> int:
    """first_difference(prev_prompt + prev_response, prompt), without building the context."""
    position = first_difference(prev_prompt, prompt)
    if position < len(prev_prompt):
        return position
    end = position + len(prev_response)
    return position + first_difference(prev_response, prompt[position:end])


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Text of `ids` exactly as the tokenizer maps them: special tokens kept, no space clean-up."""
    return tokenizer.decode(
        list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def _token_at_char(tokenizer: Any, ids: Sequence[int], char: int) -> int:
    """Index of the token of `ids` whose decoded text holds character `char` (bisect)."""
    lo, hi = 0, len(ids) - 1  # smallest i with len(decode(ids[: i + 1])) > char
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(tokenizer, ids[: mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def in_spans(i: int, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether index i lies in one of the half-open, sorted, disjoint spans [start, end)."""
    k = bisect.bisect_right(spans, (i, float("inf"))) - 1
    return k >= 0 and spans[k][0] <= i < spans[k][1]


def classify_position(position: int, response_spans: Sequence[tuple[int, int]]) -> str:
    """Kind of a break from the ids alone: where the first changed context token lies."""
    return ASSISTANT_REWRITE if in_spans(position, response_spans) else CONTEXT_REWRITE


def classify_break(
    context: Sequence[int],
    prompt: Sequence[int],
    response_spans: Sequence[tuple[int, int]],
    tokenizer: Any = None,
) -> tuple[str, int]:
    """(kind, position) of a prefix break; `response_spans` are the model responses in `context`.

    Precondition: `prompt` does not start with `context` (so position < len(context)).
    """
    position = first_difference(context, prompt)
    if position >= len(context):
        raise ValueError("classify_break: the prompt starts with the context; there is no break")
    changed = position
    if tokenizer is not None:
        context_text = decode(tokenizer, context).rstrip(
            "\ufffd"
        )  # a cut multi-byte char at the end
        prompt_text = decode(tokenizer, prompt)
        if prompt_text.startswith(context_text):
            return RETOKENIZATION, position
        char = first_difference(context_text, prompt_text)
        changed = max(position, _token_at_char(tokenizer, context, char))
    return classify_position(changed, response_spans), position


def snippet(
    context: Sequence[int], prompt: Sequence[int], position: int, tokenizer: Any = None
) -> str:
    """The context and the new prompt around `position`, for a person to see what changed."""
    lo = max(0, position - SNIPPET_TOKENS)
    a, b = context[lo : position + SNIPPET_TOKENS], prompt[lo : position + SNIPPET_TOKENS]
    if tokenizer is None:
        return f"context ids {list(a)} -> prompt ids {list(b)} (from token {lo})"
    return f"context {decode(tokenizer, a)!r} -> prompt {decode(tokenizer, b)!r}"
