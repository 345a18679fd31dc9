"""The guess demo's task module (examples/guess/task.py), loaded from its file, for the task
modules in tests/support that change one thing about it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "guess_demo_task", Path(__file__).resolve().parents[2] / "examples" / "guess" / "task.py")
guess = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(guess)
