"""A step's context counts: how each chat turn's prompt was built, over the turns the store holds.

    context_metrics([(context, reason, reused_tokens)]) -> {"context/exact": n,
        "context/rendered/<reason>": n (each of REASONS), "context/reused_tokens": n}
"""

from __future__ import annotations

from collections.abc import Sequence

from tracetrain.types import EXACT, REASONS, RENDERED


def context_metrics(turns: Sequence[tuple[str | None, str | None, int]]) -> dict[str, int]:
    """Counts over (context, reason, reused_tokens) of a step's chat turns: context/exact,
    context/rendered/<reason>, context/reused_tokens (prompt ids not rendered again)."""
    out = {"context/exact": 0, **{f"context/rendered/{r}": 0 for r in REASONS},
           "context/reused_tokens": 0}
    for context, reason, reused in turns:
        if context == EXACT:
            out["context/exact"] += 1
            out["context/reused_tokens"] += reused or 0
        elif context == RENDERED:  # (a reason of an older store, e.g. "policy": counted as it is)
            out[f"context/rendered/{reason}"] = out.get(f"context/rendered/{reason}", 0) + 1
    return out
