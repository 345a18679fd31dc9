"""The package's shape (docs/architecture.md), counting imports made inside functions too:

- every module sits in a layer of LAYERS and imports only its own layer and the layers before it
  (the walk goes one way: a stage never reaches back up to what calls it);
- no two modules import each other, directly or through others;
- the pure stages (rows, objective, learn, and what the viewer recomputes) reach no I/O module;
- no module is over MAX_LINES lines but the documented config; no function of the loop or the
  update and the engine (run/, learn/, engines/) over MAX_FUNCTION_LINES; tests/ mirrors the folders.

Each rule is also run on a copy of the package with a violation planted, and must catch it.
"""

from __future__ import annotations

import ast
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tracetrain"
TESTS = Path(__file__).resolve().parent

# Low to high. A module may import modules of its own layer and of the layers before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    # the data model; the names a config can choose; where a named file is
    ("tracetrain.types", "tracetrain.registry", "tracetrain.paths"),
    ("tracetrain.config",),  # the typed run config
    ("tracetrain.agents",),  # tasks, datasets, the runner (agents call the gateway over HTTP)
    ("tracetrain.envs",),  # environments as task sources (their agents run on the runner)
    ("tracetrain.models",),  # the policy and its tokenizer, LoRA
    ("tracetrain.engines",),  # generation with token ids and logprobs
    ("tracetrain.store",),  # turns, rewards, events, durably
    ("tracetrain.gateway",),  # an agent's request -> a recorded turn (calls engines, store)
    ("tracetrain.rows",),  # rollouts -> rows
    ("tracetrain.objective",),  # advantages, credit, token weights, the loss, mini-batches
    ("tracetrain.learn",),  # logprobs, packing, the updates
    ("tracetrain.run",),  # the step and the loop around it
    ("tracetrain.integrations",),  # the same step on verl
    ("tracetrain.view",),  # a run directory, read-only -> what happened to each token
    ("tracetrain", "tracetrain.cli", "tracetrain.__main__"),  # the package's face, the commands
)
PURE = ("tracetrain.rows", "tracetrain.objective", "tracetrain.learn", "tracetrain.view.explain",
        "tracetrain.view.charts", "tracetrain.view.tokens")
IO = ("tracetrain.store", "tracetrain.gateway", "tracetrain.agents", "tracetrain.envs", "tracetrain.engines",
      "tracetrain.run", "tracetrain.integrations", "tracetrain.view.read", "tracetrain.view.app",
      "tracetrain.view.serve", "tracetrain.view.inspection")
MAX_LINES = 500
MAX_FUNCTION_LINES = 60  # run/, learn/, engines/: a function fits on a screen
SHORT_FUNCTIONS = ("run", "learn", "engines")
LONGER_ALLOWED: set[str] = set()  # none: a module that grows past the limit is split


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


def in_package(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the most specific entry that holds `module` ("tracetrain" holds
    only the package's own __init__: a new top-level module has no layer)."""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            holds = module == name if name == "tracetrain" else in_package(module, name)
            if holds and (best is None or len(name) > len(best[1])):
                best = (i, name)
    return None if best is None else best[0]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module's layer comes after the importer's,
    and (module, "no layer") for a module no entry of LAYERS holds."""
    out = [(m, "no layer") for m in graph if layer_of(m) is None]
    for m, targets in graph.items():
        out += [(m, t) for t in sorted(targets)
                if None not in (layer_of(m), layer_of(t)) and layer_of(t) > layer_of(m)]
    return sorted(out)


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def impure(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """{pure module: the I/O modules it reaches, however indirectly} (empty when all is well)."""
    out = {}
    for m in graph:
        if any(in_package(m, p) for p in PURE):
            bad = sorted(x for x in reached(graph, m) if any(in_package(x, io) for io in IO))
            if bad:
                out[m] = bad
    return out


def long_modules(root: Path = PACKAGE) -> dict[str, int]:
    """{path: lines} of the modules over MAX_LINES, but those allowed."""
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in LONGER_ALLOWED:
            out[rel] = n
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    graph = import_graph()
    assert "tracetrain.run.step" in graph["tracetrain.run.trainer"]
    assert cycles(graph) == []


def test_every_module_imports_only_its_layer_and_those_before_it():
    graph = import_graph()
    assert "tracetrain.rows.aggregate" in graph["tracetrain.run.step"]  # the graph is the real one
    assert upward_imports(graph) == []


@pytest.mark.parametrize("stage", PURE)
def test_a_pure_stage_reaches_no_io_module(stage):
    """rows, the objective, the learner and what the viewer recomputes from them are functions
    over plain data: nothing they import, however indirectly, is the store, the gateway, the
    runner, an engine, the loop or the viewer's server."""
    graph = import_graph()
    assert any(in_package(m, stage) for m in graph), stage
    assert {m: bad for m, bad in impure(graph).items() if in_package(m, stage)} == {}


def test_a_file_a_config_names_is_looked_up_in_one_place():
    """Beside the config file, then the working directory: only tracetrain/paths.py says how."""
    looking = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                     if "Path.cwd()" in p.read_text() and p.name != "paths.py")
    assert looking == []


def test_no_module_is_over_the_limit():
    assert long_modules() == {}


def test_tests_mirror_the_package_folders():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    test_folders = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert test_folders and test_folders <= folders, test_folders - folders
    for p in TESTS.glob("*/test_*.py"):
        assert not (TESTS / p.name).exists(), p.name  # one test module per name (pytest's rootdir imports)
    assert not any((TESTS / "support").glob("test_*.py"))  # helpers only: no tests hide there


def stray_modules(names: list[str]) -> list[str]:
    """The modules at tests/ root that are neither the conftest nor a test file: a helper belongs
    in tests/support/ (which the conftest puts on sys.path)."""
    allowed = {"conftest.py", "__init__.py"}
    return sorted(n for n in names if n.endswith(".py") and n not in allowed and not n.startswith("test_"))


def test_tests_root_holds_only_the_conftest_and_test_modules():
    assert (TESTS / "support").is_dir()
    assert stray_modules([p.name for p in TESTS.glob("*.py")]) == []


def test_the_rules_catch_a_planted_helper_at_the_tests_root():
    names = [p.name for p in TESTS.glob("*.py")]
    assert "conftest.py" in names and "test_architecture.py" in names  # the listing is the real one
    assert stray_modules([*names, "fake_upstream.py", "README.md"]) == ["fake_upstream.py"]


def stray_in_folders(paths: list[str]) -> list[str]:
    """The modules under a test folder (tests/envs, tests/run/..., not tests/support/), given as
    paths relative to tests/, that are not test modules: a helper belongs in tests/support/."""
    names = {p: p.rpartition("/")[2] for p in paths}
    return sorted(p for p, n in names.items() if n.endswith(".py") and "/" in p
                  and not p.startswith("support/") and not n.startswith("test_") and n != "conftest.py")


def test_test_folders_hold_only_test_modules():
    paths = [p.relative_to(TESTS).as_posix() for p in TESTS.glob("*/**/*.py")]
    assert "envs/test_openenv.py" in paths and "support/tool_envs.py" in paths  # the real listing
    assert stray_in_folders(paths) == []


def test_the_rules_catch_a_planted_helper_in_a_test_folder():
    paths = [p.relative_to(TESTS).as_posix() for p in TESTS.glob("*/**/*.py")]
    planted = ["envs/tool_envs.py", "envs/vf_envs/vf_calc.py", "envs/__init__.py"]
    assert stray_in_folders([*paths, *planted, "envs/README.md"]) == sorted(planted)


@pytest.fixture
def package_copy(tmp_path) -> Path:
    root = tmp_path / "tracetrain"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", "static", "templates"))
    return root


def plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_the_rules_catch_a_planted_upward_import(package_copy):
    """rows/aggregate.py importing the step: an import up the layers, and a circle with it."""
    assert upward_imports(import_graph(package_copy)) == []
    plant(package_copy, "rows.aggregate", "from tracetrain.run.step import rows")
    graph = import_graph(package_copy)
    assert ("tracetrain.rows.aggregate", "tracetrain.run.step") in upward_imports(graph)
    assert any("tracetrain.rows.aggregate" in c and "tracetrain.run.step" in c for c in cycles(graph))


def test_the_rules_catch_a_planted_import_of_the_environments_by_the_agents(package_copy):
    """The environments use the agents' datasets and runner, never the other way round."""
    plant(package_copy, "agents.tasks", "def f():\n    from tracetrain.envs import open_environment")
    assert ("tracetrain.agents.tasks", "tracetrain.envs") in upward_imports(import_graph(package_copy))


def test_the_rules_catch_a_planted_io_import_in_a_pure_stage(package_copy):
    """objective/loss.py importing the store from inside a function: the store's layer is below
    the objective's, so only the purity rule catches it."""
    assert impure(import_graph(package_copy)) == {}
    plant(package_copy, "objective.loss", "def f():\n    from tracetrain.store import SQLiteStore")
    graph = import_graph(package_copy)
    assert "tracetrain.store" in impure(graph)["tracetrain.objective.loss"]
    assert upward_imports(graph) == []
    # and what imports the loss is now impure too
    assert "tracetrain.store" in impure(graph)["tracetrain.learn.update"]


def test_the_rules_catch_a_planted_module_outside_the_layers(package_copy):
    (package_copy / "helpers.py").write_text("X = 1\n")
    assert ("tracetrain.helpers", "no layer") in upward_imports(import_graph(package_copy))


def long_functions(root: Path = PACKAGE) -> dict[str, int]:
    """{path:line name: lines} of the functions in SHORT_FUNCTIONS over MAX_FUNCTION_LINES."""
    out = {}
    for folder in SHORT_FUNCTIONS:
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        out[f"{path.relative_to(root.parent).as_posix()}:{node.lineno} {node.name}"] = n
    return out


def test_no_function_of_the_loop_or_the_update_is_over_the_limit():
    assert long_functions() == {}


def test_the_rules_catch_a_planted_long_function(package_copy):
    assert long_functions(package_copy) == {}
    plant(package_copy, "learn.update", "def planted():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert [k.split(" ")[1] for k in long_functions(package_copy)] == ["planted"]


README_MAX_LINES = 130  # a one-page README; reference material lives in docs/


def test_the_readme_is_one_page():
    n = len((PACKAGE.parent / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines "
                                   f"(at most {README_MAX_LINES}: move detail to docs/)")


def test_the_rules_catch_a_planted_long_module(package_copy):
    assert long_modules(package_copy) == {}
    plant(package_copy, "rows.drift", "\n" * MAX_LINES)
    assert list(long_modules(package_copy)) == ["tracetrain/rows/drift.py"]


def test_every_engine_kind_the_config_accepts_has_a_starter_and_no_other():
    from pydantic import TypeAdapter

    from tracetrain.config import EngineConfig
    from tracetrain.engines.start import ENGINE_KINDS, start_local, start_vllm

    assert dict(ENGINE_KINDS) == {"local": start_local, "vllm": start_vllm}
    engine = TypeAdapter(EngineConfig)  # the union of one model per kind
    assert engine.validate_python({"kind": "local"}).kind == "local"
    assert engine.validate_python({"kind": "vllm", "python": "python"}).kind == "vllm"
    with pytest.raises(ValueError, match="engine.kind: unknown engine kind 'upstream'; known: local, vllm"):
        engine.validate_python({"kind": "upstream"})
