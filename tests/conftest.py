"""Hypothesis for the whole suite: no per-example deadline (a GC pause or a busy machine is not a
failure of the code under test); the examples stay random, so invariants keep being explored.

The tests' helper modules live in tests/support/ and are imported by bare name
(`from gateway_fixtures import ...`): that folder goes on sys.path here, before any test module is
imported (spawned processes inherit it)."""

import sys
from pathlib import Path

import pytest
from hypothesis import settings

SUPPORT = str(Path(__file__).resolve().parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

settings.register_profile("tracetrain", deadline=None)
settings.load_profile("tracetrain")


@pytest.fixture
def clean_registries():
    """The registries and sys.modules as they were before the test: a name a test registers (or a
    config's plugin does) does not reach the tests that enumerate the registries; a plugin module
    is imported again, and registers again, by the next config that names it."""
    from tracetrain import registry

    saved = [(r, dict(r._entries)) for rs in registry.KEYS.values() for r in rs]
    modules = set(sys.modules)
    yield
    for r, entries in saved:
        r._entries.clear()
        r._entries.update(entries)
    for name in set(sys.modules) - modules:
        if name.startswith("tracetrain_plugin_"):
            del sys.modules[name]


def pytest_configure(config):
    """What tracetrain converts once (a GGUF checkpoint: models/gguf_cache.py) is cached for this
    session alone, in a temporary folder its subprocesses share: the first test that loads a
    checkpoint converts it, as on a fresh machine, and nothing is written to the user's cache."""
    import os
    import tempfile

    config._tracetrain_cache = tempfile.mkdtemp(prefix="tracetrain-cache-")
    os.environ["TRACETRAIN_CACHE"] = config._tracetrain_cache


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(getattr(config, "_tracetrain_cache", ""), ignore_errors=True)
