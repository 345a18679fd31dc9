"""docs/config.md is generated from the typed config and stays in step with it: every key has a
meaning in the code, the file is what the generator prints, and the defaults it shows are the
config's defaults (read back through both ways of setting a key)."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from tracetrain.config import (
    EXTERNAL_DESCRIPTIONS,
    REFERENCE_COMMAND,
    ConfigError,
    TrainConfig,
    build_config,
    config_reference,
    describe,
    leaf_keys,
)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"


def kinds(annotation) -> list[type[BaseModel]]:
    """The models of a section that is a union of them, one per kind (`engine`; `env`, a union or
    null), else []."""
    for union in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(union) is typing.Annotated:  # the discriminator around the union
            union = typing.get_args(union)[0]
        inner = [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
                 for a in typing.get_args(union)]
        models = [a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) > 1 and len(models) == len(inner):
            return models
    return []


def walk(model: type[BaseModel] | list[type[BaseModel]], prefix: str = ""):
    """(dotted key, model, field name) of every leaf of `model`, found independently of the
    generator's own walk: a section's own keys (an optional section, model.lora, is one: null
    is off), then the sections below it in field order. A union section (a list of models, one
    per kind): each key once, with the first model that has it."""
    below, seen = [], set()
    for m in model if isinstance(model, list) else [model]:
        for name, field in m.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            if key in seen:
                continue
            seen.add(key)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                assert field.annotation.__doc__, f"section {key!r} has no docstring (its intro)"
                below.append((field.annotation, key))
                continue
            if kinds(field.annotation):
                assert all(k.__doc__ for k in kinds(field.annotation)), f"a kind of {key!r} has no docstring"
                below.append((kinds(field.annotation), key))
                if type(None) in typing.get_args(field.annotation):  # a key too (null: off)
                    yield key, m, name
                continue
            yield key, m, name
            inner = [a for a in typing.get_args(field.annotation) if a is not type(None)]
            if len(inner) == 1 and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
                below.append((inner[0], key))
    for section, key in below:
        yield from walk(section, key)


# Optional sections that must be given a choice (env: which standard, and its source): their
# keys' defaults are checked one by one below, not as a section built at its defaults.
A_CHOICE = {"env", "warm_start.expert", "distill", "distill.teacher.lora"}


def optional_sections(rows: dict[str, dict[str, str]]) -> set[str]:
    """Keys that are null by default and have keys below them (set, they switch a feature on)."""
    return {k for k, r in rows.items() if r["default"] == "null" and any(x.startswith(k + ".") for x in rows)}


def doc_rows(text: str) -> dict[str, dict[str, str]]:
    """{key: {column: cell}} of the tables in the reference (cells unescaped, backticks off)."""
    rows: dict[str, dict[str, str]] = {}
    columns = ["key", "type", "default", "constraints", "meaning"]
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == len(columns), line
        row = dict(zip(columns, cells, strict=True))
        for col in ("key", "type", "default"):
            row[col] = row[col].removeprefix("`").removesuffix("`")
        assert row["key"] not in rows, f"{row['key']!r} appears twice"
        rows[row["key"]] = row
    return rows


def test_doc_is_generated_from_the_config():
    want = config_reference()
    have = DOC.read_text() if DOC.is_file() else ""
    if have != want:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                 "docs/config.md", "config_reference()"))[:60])
        raise AssertionError(f"docs/config.md is out of date with tracetrain/config/; regenerate "
                             f"it with `{REFERENCE_COMMAND}`\n{diff}")


def test_the_documented_command_prints_the_reference():
    out = subprocess.run([sys.executable, "-m", "tracetrain.config", "--markdown"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out == config_reference()


def test_every_key_has_a_meaning():
    keys = list(walk(TrainConfig))
    missing = [key for key, model, name in keys if not describe(model, name)]
    assert not missing, (f"config keys without a description: {missing}; give each one an "
                         "attribute docstring (a string on the line after the field)")
    assert [k for k, _, _ in leaf_keys()] == [k for k, _, _ in keys]
    for model, descriptions in EXTERNAL_DESCRIPTIONS.items():  # no entry for a key that is gone
        assert set(descriptions) <= set(model.model_fields), model.__name__


def test_doc_lists_every_key_once_with_its_meaning():
    rows = doc_rows(config_reference())
    assert list(rows) == [key for key, _, _ in walk(TrainConfig)]
    assert all(row["meaning"] and row["type"] for row in rows.values())
    assert rows["model.kind"]["type"] == "tiny | pretrained | gguf"
    assert rows["loss.dual_clip"]["type"] == "float | null"
    assert rows["rollout.top_p"]["constraints"] == "> 0, <= 1"


def test_documented_defaults_are_the_defaults():
    """Each default as the doc shows it, given back as a command-line override and as YAML,
    builds the default config; and key by key, it is the default's value."""
    rows = doc_rows(DOC.read_text())
    optional = optional_sections(rows)
    under = {k: r for k, r in rows.items() if any(k.startswith(o + ".") for o in optional)}
    for o in sorted(optional):  # an optional section's keys at their defaults: the section's default
        inner = [x for x in optional if x.startswith(o + ".")]  # (a section null inside it)
        given = [f"{k}={r['default']}" for k, r in under.items()
                 if k.startswith(o + ".") and r["default"] != "required"
                 and not any(k.startswith(x + ".") for x in inner)]
        if o in A_CHOICE:  # no section is its defaults: building one at them is refused
            with pytest.raises(ConfigError, match=o.replace(".", r"\.")):
                build_config({}, given)
            continue
        got = build_config({}, given)
        for p in o.split("."):
            got = getattr(got, p)
        assert got == type(got)(), o
    models = {key: (model, name) for key, model, name in leaf_keys()}
    for key, row in under.items():  # key by key: the field's own default
        model, name = models[key]
        field = model.model_fields[name]
        if row["default"] == "required":
            assert field.is_required(), key
            continue
        value = field.default_factory() if field.default_factory else field.default
        assert yaml.safe_load(row["default"]) == value, key
    default = TrainConfig()

    def value_at(key: str):
        got = default
        for p in key.split("."):
            got = getattr(got, p)
        return got

    for key in [k for k in rows if k not in under]:  # a key of another kind than the default's
        try:
            value_at(key)
        except AttributeError:
            under[key] = rows[key]
            model, name = models[key]
            field = model.model_fields[name]
            value = field.default_factory() if field.default_factory else field.default
            assert yaml.safe_load(rows[key]["default"]) == value, key
    rows = {k: r for k, r in rows.items() if k not in under}
    overrides = [f"{key}={row['default']}" for key, row in rows.items()]
    assert build_config({}, overrides) == default
    tree: dict = {}
    for key, row in rows.items():
        *parents, last = key.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = yaml.safe_load(row["default"])
    assert build_config(tree) == default
    dumped = default.model_dump()
    for key, row in rows.items():
        value = dumped
        for p in key.split("."):
            value = value[p]
        shown = yaml.safe_load(row["default"])
        assert shown == value and type(shown) is type(value), (
            f"{key}: the doc shows {row['default']!r}, the default is {value!r}")
