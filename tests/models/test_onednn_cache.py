"""`import tracetrain` bounds oneDNN's primitive caches (tracetrain/__init__.py): a process that runs
bf16 matmuls of many shapes (packed rows of a new length every step) stops growing at the cap.
The measurement is bench/bench_onednn_cache.py's: 1,200 bf16 matmuls, each of a new shape."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_onednn_cache import growth  # noqa: E402


def test_import_sets_the_caps_and_a_users_own_value_wins():
    assert growth("import tracetrain")["caps"] == ["128", "128"]
    mine = growth("import tracetrain", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1000", LRU_CACHE_CAPACITY="7")
    assert mine["caps"] == ["1000", "7"]


def test_capped_caches_hold_less_than_the_default():
    """Without tracetrain the 1,200 shapes fill the default 1,024 entries (~1 MB a shape, the two
    caches together, where oneDNN runs bf16 matmuls); imported first, tracetrain keeps 128 of them:
    under half the growth."""
    plain = growth()
    assert plain["caps"] == [None, None]
    if plain["growth_mb"] < 200:
        pytest.skip(f"bf16 matmuls here do not go through oneDNN's caches "
                    f"(1,200 shapes grew the process by {plain['growth_mb']:.0f} MB)")
    capped = growth("import tracetrain")
    assert capped["growth_mb"] < plain["growth_mb"] / 2, (capped, plain)
