"""Hypothesis for the whole suite: no per-example deadline (a GC pause or a busy machine is not a
failure of the code under test); the examples stay random, so invariants keep being explored.

The tests' helper modules live in tests/support/ and are imported by bare name
(`from gateway_fixtures import ...`): that folder goes on sys.path here, before any test module is
imported (spawned processes inherit it)."""

import sys
from pathlib import Path

from hypothesis import settings

SUPPORT = str(Path(__file__).resolve().parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

settings.register_profile("tracetrain", deadline=None)
settings.load_profile("tracetrain")
