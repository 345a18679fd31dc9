"""Requests that join a running batch (tests/engines/test_engine_join.py, test_families.py)."""

from __future__ import annotations

import asyncio


def with_late_requests(eng, first, late, join_after):
    """`first` (prompt, params) starts alone; each of `late` is sent when the first's stream has
    `join_after[k]` tokens. Returns (first's generation, the late ones' generations)."""

    async def go():
        loop = asyncio.get_running_loop()
        seen, sent = [0], {}

        def on_tokens(ids):
            seen[0] += len(ids)
            for k, ((p, sp), after) in enumerate(zip(late, join_after, strict=True)):
                if after == seen[0]:
                    sent[k] = loop.create_task(eng.generate(p, sp))

        try:
            head = await eng.generate(*first, on_tokens=on_tokens)
            return head, await asyncio.gather(*(sent[k] for k in range(len(late))))
        finally:
            await eng.aclose()

    return asyncio.run(go())
