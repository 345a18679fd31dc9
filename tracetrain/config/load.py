"""A config from a YAML file plus `key.sub=value` overrides, and the errors that name the key."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ValidationError,
)

from tracetrain.config.sections import ConfigError, TrainConfig


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override {key!r}: empty key part")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {p!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["optim.lr=1e-3", "trainer.steps=5"]` -> nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _set_dotted(tree, key.strip(), _scalar(raw.strip()))
    return tree


def _scalar(raw: str) -> Any:
    """A command-line value: int, then float (YAML 1.1 reads `1e-3` as a string), then YAML."""
    for parse in (int, float):
        try:
            return parse(raw)
        except ValueError:
            pass
    return yaml.safe_load(raw) if raw else ""


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


_KEYED = re.compile(r"^Value error, ([a-z_]+(?:\.[a-z_]+)*): (.*)$", re.S)


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(config)"
        keyed = _KEYED.match(e["msg"])
        if keyed and "." not in keyed[1] and e["loc"]:  # a field's own check: its key is the loc
            keyed = None
        if keyed:  # a check across keys ("KEY: why"): the input is a whole section, not shown
            lines.append(f"config key {keyed[1]!r}: {keyed[2]}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"config key {key!r}: unknown key")
        else:
            lines.append(f"config key {key!r}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def build_config(data: dict[str, Any] | None = None, overrides: list[str] | None = None, *,
                 base_dir: str | Path | None = None) -> TrainConfig:
    """The config `data` with `overrides` applied; `plugins` given as .py paths are looked for in
    `base_dir` (the config file's folder), then the working directory."""
    tree = _merge(data or {}, parse_overrides(overrides or []))
    try:
        return TrainConfig.model_validate(tree, context={"base_dir": base_dir})
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".json":  # a run's config.json (YAML 1.1 would read 1e-06 as a string)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {str(path)!r}: not JSON ({e})") from None
    else:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r}: not YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return build_config(data, overrides, base_dir=path.resolve().parent)


# ------------------------------------------------------------- the reference (docs/config.md)

