"""LocalEngine's cumulative timers (stats prefill_s, decode_forward_s, sample_s, bench/bench_floor.py's
breakdown): each grows with its own work only."""

from __future__ import annotations

import time

from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.models.tiny import build_model, build_tokenizer

KEYS = ("prefill_s", "decode_forward_s", "sample_s")


def test_timers_grow_with_their_work():
    tok = build_tokenizer()
    eng = LocalEngine(build_model(tok, seed=0), tok, seed=0)
    eng.stop_ids = frozenset()  # every row runs to max_tokens
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 12, 13, 15]]
    assert all(eng.stats[k] == 0.0 for k in KEYS)
    t = time.perf_counter()
    eng.generate_batch(prompts, SamplingParams(max_tokens=1, seed=1))
    assert sum(eng.stats[k] for k in KEYS) <= time.perf_counter() - t
    one = {k: eng.stats[k] for k in KEYS}
    # one token: a prefill and a draw, no decode forward
    assert one["prefill_s"] > 0 and one["sample_s"] > 0 and one["decode_forward_s"] == 0.0
    assert eng.stats["forward_calls"] == 2  # the shared prefix, then the rows' rest
    t = time.perf_counter()
    eng.generate_batch(prompts, SamplingParams(max_tokens=6, seed=1))
    wall = time.perf_counter() - t
    assert eng.stats["forward_calls"] == 2 + 1 + 5  # (the prefix from the cache) + 5 decode steps
    grew = [eng.stats[k] - one[k] for k in KEYS]
    assert all(g > 0 for g in grew) and sum(grew) <= wall  # parts of the call, none twice
