"""docs/config.md: every key with its type, default, constraints and meaning, generated from the
section models (`python -m tracetrain.config --markdown > docs/config.md`)."""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
)

from tracetrain import registry
from tracetrain.config.base import Registered, union_sections
from tracetrain.config.serving import VerlConfig
from tracetrain.config.train import TrainConfig

REFERENCE_COMMAND = "python -m tracetrain.config --markdown > docs/config.md"

# Descriptions of the keys of sections defined elsewhere without attribute docstrings (the verl
# section, tracetrain/integrations/verl/config.py); a field's own description wins.
EXTERNAL_DESCRIPTIONS: dict[type[BaseModel], dict[str, str]] = {
    VerlConfig: {
        "nnodes": "Nodes of the Ray cluster verl uses.",
        "n_gpus_per_node": "GPUs per node (the actor and the rollout servers share them).",
        "strategy": "verl's actor strategy, `fsdp` or `fsdp2` (the engines the loss scaling was "
                    "checked against).",
        "rollout": "verl's rollout server; the gateway calls it.",
        "rollout_tp": "Tensor-parallel size of one rollout replica (it must divide the GPUs).",
        "gpu_memory_utilization": "The rollout servers' share of GPU memory while awake.",
        "param_offload": "FSDP CPU offload of the parameters.",
        "optimizer_offload": "FSDP CPU offload of the optimizer state.",
        "gradient_checkpointing": "verl's model option `enable_gradient_checkpointing`.",
        "use_remove_padding": "Packed sequences (needs flash-attn on the GPUs).",
        "ray_address": "null: start a local Ray (or join RAY_ADDRESS if set); `auto`: the running "
                       "cluster.",
        "overrides": "Dotted verl config keys, applied last (`+key` adds a key verl's yaml does "
                     "not have).",
    },
}


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _optional_section(annotation: Any) -> type[BaseModel] | None:
    """X for a field typed `X | None` with X a section (model.lora), else None."""
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 and _is_section(args[0]) else None


def _holds_a_value(annotation: Any) -> bool:
    """Whether a field is a key of its own: a value, or a section that may be null (null: off);
    not a section that is always there (`model`, `engine`)."""
    import typing

    if _is_section(annotation):
        return False
    return not union_sections(annotation) or type(None) in typing.get_args(annotation)


def describe(model: type[BaseModel], name: str) -> str:
    """The meaning of `model`'s field `name`: its attribute docstring, else
    EXTERNAL_DESCRIPTIONS."""
    text = (model.model_fields[name].description
            or EXTERNAL_DESCRIPTIONS.get(model, {}).get(name, ""))
    return " ".join(text.split())


def sections(
    model: type[BaseModel] = TrainConfig, prefix: str = ""
) -> list[tuple[str, type[BaseModel]]]:
    """[(dotted prefix, model)]: the top level ("") and every section below it, in field order; a
    section that is a tagged union (`engine`, one model per kind) once per model."""
    out: list[tuple[str, type[BaseModel]]] = [(prefix, model)]
    for name, field in model.model_fields.items():
        section = field.annotation if _is_section(field.annotation) else _optional_section(field.annotation)
        below = f"{prefix}.{name}" if prefix else name
        if section is not None:  # an optional one is also a key of its own (null: off)
            out += sections(section, below)
        # a union's kinds first, then the sections below them (the kinds' keys stay together)
        nested = [sections(variant, below) for variant in union_sections(field.annotation).values()]
        out += [n[0] for n in nested] + [s for n in nested for s in n[1:]]
    return out


def leaf_keys() -> list[tuple[str, type[BaseModel], str]]:
    """[(dotted key, model, field name)] of every key that holds a value (not a section), once
    (a key of several kinds of a union section: with the first model that has it)."""
    out: dict[str, tuple[str, type[BaseModel], str]] = {}
    for prefix, model in sections():
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            if _holds_a_value(field.annotation):
                out.setdefault(key, (key, model, name))
    return list(out.values())


def _type_name(tp: Any) -> str:
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is typing.Annotated:  # ObjectSpec, registered(...): the value's own type
        return _type_name(args[0])
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(parts + (["null"] if type(None) in args else []))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def _yaml_value(value: Any) -> str:
    """`value` as YAML writes it in flow style (`null`, `true`, `1.0e-06`, `[]`)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text.removesuffix("...").strip()


def _default(field: Any) -> Any:
    return field.default_factory() if field.default_factory is not None else field.default


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _constraints(field: Any) -> list[str]:
    out = []
    for m in field.metadata:
        if isinstance(m, Registered):
            aliases = {a: n for r in registry.KEYS[m.key] for a, n in r.aliases.items()}
            names = [f"`{n}`" + (f" (= `{aliases[n]}`)" if n in aliases else "")
                     for n in registry.known(m.key, builtin=True)]
            out.append("a registered name: " + ", ".join(names))
        for attr, op in _BOUNDS:
            if getattr(m, attr, None) is not None:
                out.append(f"{op} {getattr(m, attr)}")
        if getattr(m, "min_length", None) is not None:
            out.append(f"length >= {m.min_length}")
        if getattr(m, "pattern", None) is not None:
            out.append(f"matches `{m.pattern}`")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


_HEADER = f"""\
# Configuration reference

<!-- Generated from the section models of tracetrain/config/ by `{REFERENCE_COMMAND}`; do not edit.
     tests/test_config_docs.py fails when the two differ. -->

A run is configured by a YAML file, and `key.sub=value` overrides after it on the command line
are applied over the file:

```bash
tracetrain train examples/guess/config.yaml optim.lr=3e-4 trainer.steps=200
```

```yaml
# the same in the file
optim: {{lr: 3.0e-4}}
trainer:
  steps: 200
```

An override's value is read as an int, else a float, else a YAML value (`true`, `null`,
`[a, b]`, `{{k: v}}`; anything else is a string). In the YAML file an exponent needs a dot and a
sign (`3.0e-4`): YAML 1.1 reads `3e-4` as a string, which a float key refuses.
`tracetrain train --backend verl` is the same as the override `backend=verl`.

Every key is typed and checked when the config is built: an unknown key, a value of the wrong
type (nothing is coerced: `trainer.steps=true` and `optim.lr="0.1"` are refused) or one outside
its constraints is an error that names the key. Defaults are shown as YAML writes them; a key
not given takes its default. Some rules tie keys together (e.g. `model.path` is required for
`model.kind: pretrained`); they are given with the keys they concern.
"""


def _intro(model: type[BaseModel], note: str) -> str:
    import inspect

    doc = inspect.cleandoc(model.__doc__ or "")
    return "\n\n".join(p for p in (doc, note) if p)


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(i for i in items if i))


def _rows(prefix: str, models: list[type[BaseModel]], tags: dict[type[BaseModel], str],
          default_model: type[BaseModel] | None) -> list[str]:
    """The table rows of a section: one model's keys, or those of a union's models (`engine`), each
    key once, marked with the kinds that have it when not all do."""
    names = _unique([n for m in models for n, f in m.model_fields.items()
                     if _holds_a_value(f.annotation)])
    rows = []
    for name in names:
        having = [m for m in models if name in m.model_fields]
        field = (default_model if default_model in having else having[0]).model_fields[name]
        meanings: dict[str, list[str]] = {}  # meaning -> the kinds it is of
        for m in having:
            meanings.setdefault(describe(m, name), []).append(f"`{tags.get(m)}`")
        meaning = " ".join(meanings) if len(meanings) == 1 or name == "kind" else " ".join(
            f"{' and '.join(k)}: {text}" for text, k in meanings.items())
        if len(having) < len(models):
            labels = ["a plugin's" if tags[m] == "plugin" else f"`{tags[m]}`" for m in having]
            by_kind = all("kind" in m.model_fields for m in models)  # else a form, by its keys
            meaning = (f"(kind {' or '.join(labels)}) " if by_kind
                       else f"(the {' or '.join(labels)} form) ") + meaning
        others = {}  # the kinds whose default is not the one shown (`kind`'s own: its tag)
        for m in having if name != "kind" else ():
            f = m.model_fields[name]
            if not f.is_required() and (field.is_required() or _default(f) != _default(field)):
                others.setdefault(_code(_yaml_value(_default(f))), []).append(f"`{tags[m]}`")
        meaning += "".join(f" Default for kind {', '.join(k)}: {v}." for v, k in others.items())
        key = f"{prefix}.{name}" if prefix else name
        cells = [_code(key),
                 _code(" | ".join(_unique([t for m in having
                                           for t in _type_name(m.model_fields[name].annotation)
                                           .split(" | ")]))),
                 "required" if field.is_required() else _code(_yaml_value(_default(field))),
                 ", ".join(_unique([c for m in having for c in _constraints(m.model_fields[name])])),
                 meaning]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return rows


def config_reference() -> str:
    """docs/config.md: every key of TrainConfig with its type, default, constraints and meaning,
    generated from the models (deterministic)."""
    parts, found = [_HEADER], {}
    for prefix, model in sections():
        found.setdefault(prefix, []).append(model)
    for prefix, models in found.items():
        title = f"`{prefix}`" if prefix else "Top level"
        parent, _, last = prefix.rpartition(".")
        # the model above that has this section (of a union above: the kind that has it)
        owner = next(m for m in found[parent] if last in m.model_fields) if prefix else None
        field = owner.model_fields[last] if owner is not None else None
        note = describe(owner, last) if owner is not None else ""  # the section's own field
        tags = {m: t for t, m in union_sections(field.annotation).items()} if field else {}
        default = _default(field) if field is not None and not field.is_required() else None
        docs = [_intro(m, "") for m in models]  # a union's: what it is, then each kind
        lines = [f"## {title}", "", _intro_join(*(docs + [note] if len(models) == 1 else [note] + docs)), "",
                 "| key | type | default | constraints | meaning |", "|---|---|---|---|---|",
                 *_rows(prefix, models, tags, type(default) if isinstance(default, BaseModel) else None)]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def _intro_join(*paragraphs: str) -> str:
    return "\n\n".join(p for p in paragraphs if p)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m tracetrain.config",
                                description="Print the configuration reference.")
    p.add_argument("--markdown", action="store_true", required=True,
                   help=f"the Markdown reference (`{REFERENCE_COMMAND}`)")
    p.parse_args(argv)
    sys.stdout.write(config_reference())
    return 0


