"""A config from a YAML file plus `key.sub=value` overrides, and the errors that name the key."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    Discriminator,
    ValidationError,
)

from tracetrain.config.base import ConfigError, union_sections
from tracetrain.config.train import TrainConfig

# Keys that moved or were replaced: a file or an override that still gives one is told where it
# went (an error, as any unknown key).
MOVED_KEYS: dict[str, str] = {
    "trainer.overlap_collect": "replaced by trainer.collect: overlap (true) or step (false)",
    "trainer.threads": "moved to engine.threads",
    "rollout.batch_window_ms": "moved to engine.batch_window_ms (engine.kind local)",
}


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


def _kind_switched(data: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`data` less what an override of a union section's kind leaves without meaning: the keys of
    the section (`engine`) that the new kind does not take and that hold the old kind's default
    (a run's config.json has every key: `engine.kind=vllm` over a local engine's must not trip
    on its default engine.batch_window_ms). A key given another value stays, and is refused."""
    out = dict(data)
    for name, field in TrainConfig.model_fields.items():
        variants, old, new = union_sections(field.annotation), data.get(name), over.get(name)
        if not (variants and isinstance(old, dict) and isinstance(new, dict) and "kind" in new):
            continue
        tag = _discriminator(field)
        before, after = variants.get(tag(old)), variants.get(tag({**old, **new}))
        if before is None or after is None or before is after:
            continue
        out[name] = {k: v for k, v in old.items() if k in after.model_fields or k not in before.model_fields
                     or v != before.model_fields[k].get_default(call_default_factory=True)}
    return out


def _discriminator(field: Any) -> Any:
    """The function that tells the kind of a union section's value (`engine`, `env`)."""
    import typing

    metadata = [*field.metadata, *(m for a in typing.get_args(field.annotation)
                                   if typing.get_origin(a) is typing.Annotated
                                   for m in typing.get_args(a)[1:])]
    return next(m.discriminator for m in metadata if isinstance(m, Discriminator))


_KEYED = re.compile(r"^Value error, ([a-z_]+(?:\.[A-Za-z0-9_][A-Za-z0-9_-]*)*): (.*)$", re.S)


def _key(loc: tuple) -> tuple[str, dict[str, type[BaseModel]], str | None]:
    """(the dotted key of an error's `loc`, the tags of tagged unions left out; the {tag: model}
    of the union its section was read as (`engine`), or {}; that section's tag)."""
    parts: list[str] = []
    model: type[BaseModel] | None = TrainConfig
    union: dict[str, type[BaseModel]] = {}
    tag = None
    i = 0
    while i < len(loc):
        part, i = loc[i], i + 1
        parts.append(str(part))
        field = model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        if field is None:
            model = None
            continue
        variants = union_sections(field.annotation)
        if variants and i < len(loc) and loc[i] in variants:  # the tag: not a key
            model, union, tag, i = variants[loc[i]], variants, loc[i], i + 1
        else:
            model, union, tag = _section(field.annotation), {}, None
    return ".".join(parts) or "(config)", union, tag


def _section(annotation: Any) -> type[BaseModel] | None:
    import typing

    for a in (annotation, *typing.get_args(annotation)):  # X, or X | None
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _unknown(key: str, union: dict[str, type[BaseModel]], tag: str | None) -> str:
    """Why `key` is not accepted: it moved, it is a key of another kind, or it is unknown."""
    if key in MOVED_KEYS:
        return MOVED_KEYS[key]
    section, _, name = key.rpartition(".")
    kinds = [t for t, m in union.items() if t not in (tag, "plugin") and name in m.model_fields]
    if kinds:
        return (f"only for {section}.kind " + " or ".join(repr(k) for k in kinds)
                + f" ({section}.kind is {tag!r})")
    return "unknown key"


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key, union, tag = _key(e["loc"])
        keyed = _KEYED.match(e["msg"])
        if keyed and "." not in keyed[1] and e["loc"]:  # a field's own check: its key is the loc
            keyed = None
        if keyed:  # a check across keys ("KEY: why"): the input is a whole section, not shown
            lines.append(f"config key {keyed[1]!r}: {keyed[2]}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"config key {key!r}: {_unknown(key, union, tag)}")
        else:
            lines.append(f"config key {key!r}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def build_config(data: dict[str, Any] | None = None, overrides: list[str] | None = None, *,
                 base_dir: str | Path | None = None) -> TrainConfig:
    """The config `data` with `overrides` applied; `plugins` given as .py paths are looked for in
    `base_dir` (the config file's folder), then the working directory."""
    over = parse_overrides(overrides or [])
    tree = _merge(_kind_switched(data or {}, over), over)
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

