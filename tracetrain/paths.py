"""Where a file a config names is: an absolute path as given; a relative one beside the config
file (`base_dir`), then in the working directory, the first that is there. Every key that names
a file (a task module, a plugin, a data file, an object's `file.py`, an interpreter) looks it up
this one way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def candidates(value: str | Path, base_dir: str | Path | None) -> list[Path]:
    """The places `value` is looked for, in order (not resolved)."""
    if Path(value).is_absolute():
        return [Path(value)]
    return [*([Path(base_dir) / value] if base_dir is not None else []), Path.cwd() / value]


def near_config(value: str | Path, base_dir: str | Path | None,
                found: Callable[[Path], bool] = Path.exists) -> Path | None:
    """The first of `candidates(value, base_dir)` for which `found` holds (`Path.is_file` for a
    file), made absolute but not resolved (a venv's python is a link); None when none is."""
    return next((c.absolute() for c in candidates(value, base_dir) if found(c)), None)


def not_found(value: str | Path, base_dir: str | Path | None) -> str:
    """The message for a `value` found nowhere: "no file 'x' (looked in [...])"."""
    return f"no file {str(value)!r} (looked in {[str(c) for c in candidates(value, base_dir)]})"
