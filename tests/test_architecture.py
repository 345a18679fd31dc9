"""The package's shape (docs/architecture.md): no two modules import each other, directly or
through others, counting imports made inside functions; the pure stages import no I/O module."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tracetrain"


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the tracetrain modules it imports (anywhere in its file)."""
    files = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        graph[name]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [module_of(f"{node.module}.{a.name}") or module_of(node.module)
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [module_of(a.name) for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets
                               if t and t.startswith("tracetrain") and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    graph = import_graph()
    assert "tracetrain.trainer" in graph and "tracetrain.step" in graph["tracetrain.trainer"]
    assert cycles(graph) == []


@pytest.mark.parametrize("stage", ["tracetrain.aggregate", "tracetrain.advantage",
                                   "tracetrain.loss", "tracetrain.minibatch", "tracetrain.explain",
                                   "tracetrain.correction",
                                   "tracetrain.viewer.charts", "tracetrain.viewer.tokens"])
def test_a_pure_stage_reaches_no_io_module(stage):
    """aggregate, advantage, loss, mini-batches and what the viewer recomputes from them are
    functions over plain data: nothing they import, however indirectly, is the store, the
    gateway, the runner, an engine or a trainer."""
    graph, seen, todo = import_graph(), set(), [stage]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    io = ("tracetrain.store", "tracetrain.gateway", "tracetrain.runner", "tracetrain.engines",
          "tracetrain.trainer", "tracetrain.integrations", "tracetrain.step")
    assert not [m for m in seen if m.startswith(io)], seen


def test_every_engine_kind_the_config_accepts_has_a_starter_and_no_other():
    from typing import get_args

    from tracetrain.config import EngineConfig
    from tracetrain.engines.start import ENGINE_KINDS

    assert set(get_args(EngineConfig.model_fields["kind"].annotation)) == set(ENGINE_KINDS)
