"""Hypothesis for the whole suite: no per-example deadline (a GC pause or a busy machine is not a
failure of the code under test); the examples stay random, so invariants keep being explored."""

from hypothesis import settings

settings.register_profile("tracetrain", deadline=None)
settings.load_profile("tracetrain")
