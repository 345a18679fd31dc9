"""What every section is made of: `_Section` (strict, no unknown key, a docstring per key),
ConfigError, the types of keys that name a registered piece (`registered`) or a Python object
(`ObjectSpec`), and `union_sections`, the models of a section chosen by `kind`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Tag,
    ValidationInfo,
)

from tracetrain import registry
from tracetrain.paths import near_config, not_found
from tracetrain.types import UsageError


class ConfigError(UsageError):
    """A bad configuration; the message names the key."""


class Registered:
    """Field metadata: the value is a name registered for config key `key` (tracetrain/registry.py;
    docs/config.md lists the names)."""

    def __init__(self, key: str) -> None:
        self.key = key


def registered(key: str) -> Any:
    """The type of a key whose value names a registered piece: a str that must be a registered
    name or an alias, stored as the registered name the alias stands for."""
    return Annotated[str, Registered(key), AfterValidator(lambda name: registry.resolve(key, name))]


def named_once(names: list[str], what: str) -> list[str]:
    """`names` as given; ValueError when one of them is there twice (`what`: a role, a tracker)."""
    if len(set(names)) != len(names):
        raise ValueError(f"{what} named twice: {names}")
    return names


class _Section(BaseModel):
    # use_attribute_docstrings: the string literal after a field is its description (docs/config.md)
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True,
                              use_attribute_docstrings=True)


def _object_spec(value: str, info: ValidationInfo) -> str:
    """`module:name` as given; `path.py:name` with the path made absolute (relative to the config
    file, then the working directory), so worker processes and Ray find the same file."""
    target, sep, name = value.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{value!r} is not of the form 'module:name' or 'path/to/file.py:name'")
    if target.endswith(".py") and not Path(target).is_absolute():
        base = (info.context or {}).get("base_dir")
        found = near_config(target, base, Path.is_file)
        if found is None:
            raise ValueError(not_found(target, base))
        return f"{found.resolve()}:{name}"
    return value


ObjectSpec = Annotated[str, AfterValidator(_object_spec)]
"""A Python object named `module:name` or `file.py:name` (the file relative to the config file)."""


def union_sections(annotation: Any) -> dict[str, type[BaseModel]]:
    """{tag: model} of a field typed as a tagged union of sections (`engine`), or as one or null
    (`env`), else {}."""
    import typing

    for union in (annotation, *typing.get_args(annotation)):  # X, or X | None
        if typing.get_origin(union) is Annotated:  # the Discriminator around it
            union = typing.get_args(union)[0]
        out = {}
        for arg in typing.get_args(union):
            model, *meta = typing.get_args(arg) if typing.get_origin(arg) is Annotated else (arg,)
            tag = next((m.tag for m in meta if isinstance(m, Tag)), None)
            if tag is None or not (isinstance(model, type) and issubclass(model, BaseModel)):
                break
            out[tag] = model
        else:
            if out:
                return out
    return {}
