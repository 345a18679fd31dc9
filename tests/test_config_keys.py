"""No config key is accepted and ignored: every leaf key of the config (tracetrain.config.leaf_keys)
is read by the code outside tracetrain/config/, or listed in CONSUMED_ELSEWHERE with the module
that consumes it and how (checked to still say so). A key the code cannot honour on some path is
refused there with an error naming it (rollout.top_p: tested below, with the path that hands it
on from the config to the engine).

"Read" is static, over the package's syntax trees: the key's field name accessed as an attribute of
an expression that is its section, one of
    cfg.<section...>.<name>   x.cfg.<section...>.<name>   getattr(<section>, "<name>")
    <alias>.<name>            <alias> a name assigned from a section (`rc = cfg.rollout`,
                              `ec, ac = cfg.engine, cfg.aggregate`, `v = verl or cfg.verl`), or a
                              parameter annotated with the section's class (`lc: LoraConfig`)
within the function where the alias is made and the functions nested in it. A top-level key is an
attribute of `cfg` itself (or of a parameter annotated TrainConfig). Reading a property of a config
class (`cfg.reproducible`) reads the keys it reads through `self` in tracetrain/config/. The checker
is run on a made-up key nothing reads, and on planted reads of it, below: it can fail.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from gateway_fixtures import FakeEngine, live_gateway

from tracetrain.agents.runner import CommandAgent, GatewayClient
from tracetrain.config import ConfigError, build_config, leaf_keys, sections
from tracetrain.run.step import check_top_p, collect, rollout_specs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tracetrain"
CONFIG = PACKAGE / "config"

# key -> (module that consumes it, text that module holds where it does, how). Only what the
# static walk cannot see; each entry is checked to be needed and to still hold its text.
CONSUMED_ELSEWHERE: dict[str, tuple[str, str, str]] = {
    "plugins": ("tracetrain/config/train.py", "registry.import_plugins(plugins",
                "TrainConfig's own validator imports them while the config is built, before the "
                "other keys are checked against the names they register"),
    "distill.teacher.lora": ("tracetrain/config/distill.py", "self.teacher.lora is not None",
                             "DistillConfig refuses it: the teacher does not train"),
}


def section_classes() -> tuple[set[str], dict[str, frozenset[str]], str]:
    """(the section prefixes, {class name: the prefixes it is at} (ModelConfig: `model` and
    `distill.teacher`), the root's class name)."""
    found = sections()
    prefixes = {p for p, _ in found}
    at: dict[str, set[str]] = {}
    for p, model in found:
        at.setdefault(model.__name__, set()).add(p)
    root = next(model.__name__ for p, model in found if p == "")
    return prefixes, {name: frozenset(ps) for name, ps in at.items()}, root


class Reads:
    """The config keys an AST reads (module docstring), with where."""

    def __init__(self, keys: set[str], derived: dict[tuple[str, str], set[str]] | None = None):
        self.keys, self.derived = keys, derived or {}
        self.prefixes, self.classes, self.root_class = section_classes()
        self.found: dict[str, list[str]] = {}

    def section_of(self, e: ast.expr, aliases: dict[str, frozenset[str]]) -> frozenset[str] | None:
        """The section prefixes `e` may evaluate to ("" for the root config; several for a
        parameter annotated with a class at several prefixes), or None."""
        if isinstance(e, ast.Name):
            return aliases.get(e.id, frozenset({""}) if e.id == "cfg" else None)
        if isinstance(e, ast.BoolOp):  # `verl or cfg.verl or VerlConfig()`
            return next((s for v in e.values if (s := self.section_of(v, aliases)) is not None), None)
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "getattr" \
                and len(e.args) >= 2 and isinstance(e.args[1], ast.Constant):
            return self.child(self.section_of(e.args[0], aliases), e.args[1].value)
        if isinstance(e, ast.Attribute):
            if e.attr == "cfg":
                return frozenset({""})
            return self.child(self.section_of(e.value, aliases), e.attr)
        return None

    def child(self, bases: frozenset[str] | None, name: object) -> frozenset[str] | None:
        if bases is None or not isinstance(name, str):
            return None
        out = frozenset(s for b in bases if (s := f"{b}.{name}" if b else name) in self.prefixes)
        return out or None

    def read(self, bases: frozenset[str] | None, name: object, where: str) -> None:
        if bases is None or not isinstance(name, str):
            return
        for base in bases:
            key = f"{base}.{name}" if base else name
            if key in self.keys:
                self.found.setdefault(key, []).append(where)
            for k in self.derived.get((base, name), ()):  # a property of the config that reads k
                self.found.setdefault(k, []).append(f"{where} (through {key})")

    def scan(self, tree: ast.AST, path: str) -> None:
        self._visit(tree, {}, path)

    def _visit(self, node: ast.AST, outer: dict[str, str], path: str) -> None:
        aliases, own, defs = dict(outer), [], []

        def walk(n: ast.AST) -> None:
            for c in ast.iter_child_nodes(n):
                if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                    defs.append(c)
                else:
                    own.append(c)
                    walk(c)

        walk(node)
        def annotated(target: str, ann: ast.expr | None) -> None:
            text = ann.value if isinstance(ann, ast.Constant) else ast.unparse(ann) if ann else ""
            for name in str(text).replace("|", " ").replace("[", " ").replace("]", " ").split():
                if name == self.root_class:
                    aliases[target] = frozenset({""})
                elif name in self.classes:
                    aliases[target] = self.classes[name]

        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                annotated(arg.arg, arg.annotation)
        for n in own:  # `c: ReasoningGymConfig = self.config`
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                annotated(n.target.id, n.annotation)
        changed = True
        while changed:  # aliases of aliases, in any order
            changed = False
            for n in own:
                pairs = []
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple):
                            pairs += zip(t.elts, n.value.elts, strict=False)
                        else:
                            pairs.append((t, n.value))
                elif isinstance(n, (ast.AnnAssign, ast.NamedExpr)) and n.value is not None:
                    pairs.append((n.target, n.value))
                for t, v in pairs:
                    s = self.section_of(v, aliases) if isinstance(t, ast.Name) else None
                    if s is not None and aliases.get(t.id) != s:
                        aliases[t.id], changed = s, True
        for n in own:
            where = f"{path}:{getattr(n, 'lineno', '?')}"
            if isinstance(n, ast.Attribute):
                self.read(self.section_of(n.value, aliases), n.attr, where)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" \
                    and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant):
                self.read(self.section_of(n.args[0], aliases), n.args[1].value, where)
        for d in defs:
            self._visit(d, aliases, path)


def reads(sources: dict[str, str], keys: set[str],
          derived: dict[tuple[str, str], set[str]] | None = None) -> dict[str, list[str]]:
    """{key: [path:line, ...]} of the keys in `keys` that `sources` ({path: Python text}) read;
    `derived` (config_properties): reading one of those attributes reads its keys."""
    r = Reads(keys, derived)
    for path, text in sources.items():
        r.scan(ast.parse(text), path)
    return r.found


def config_properties(text: str, keys: set[str]) -> dict[tuple[str, str], set[str]]:
    """{(section prefix, attribute): the keys it reads} for the properties and public methods of
    the config's classes in `text` (tracetrain/config/): `cfg.reproducible` reads what
    TrainConfig.reproducible reads through `self`, and through the methods it calls on `self`."""
    _, classes, root = section_classes()
    prefix_of = {**classes, root: frozenset({""})}
    out: dict[tuple[str, str], set[str]] = {}
    for c in ast.parse(text).body:
        if not isinstance(c, ast.ClassDef) or c.name not in prefix_of:
            continue
        methods = {f.name: f for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        direct, calls = {}, {}
        for name, f in methods.items():
            r = Reads(keys)
            r._visit(f, {"self": prefix_of[c.name]}, "config.py")
            direct[name] = set(r.found)
            calls[name] = {n.attr for n in ast.walk(f) if isinstance(n, ast.Attribute)
                           and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr in methods}
        for name, f in methods.items():
            decorators = {ast.unparse(d) for d in f.decorator_list}
            if name.startswith("_") and not decorators & {"property", "functools.cached_property"}:
                continue
            seen, todo, got = set(), [name], set()
            while todo:
                m = todo.pop()
                if m not in seen:
                    seen.add(m)
                    got |= direct[m]
                    todo += calls[m]
            for prefix in prefix_of[c.name] if got else ():
                out[(prefix, name)] = got
    return out


def package_sources() -> dict[str, str]:
    """The package's modules but the config's own (the config does not read itself into use)."""
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))
            if CONFIG not in p.parents}


def all_keys() -> list[str]:
    return [key for key, _, _ in leaf_keys()]


def package_reads(keys: set[str]) -> dict[str, list[str]]:
    text = "\n".join(p.read_text() for p in sorted(CONFIG.glob("*.py")))
    return reads(package_sources(), keys, config_properties(text, keys))


def test_every_config_key_is_read_by_the_code_or_listed_with_its_consumer():
    keys = all_keys()
    found = package_reads(set(keys))
    unread = [k for k in keys if k not in found and k not in CONSUMED_ELSEWHERE]
    assert unread == [], f"config keys nothing reads (ignored when set): {unread}"


def test_the_listed_consumers_are_needed_and_still_consume_their_keys():
    keys = set(all_keys())
    found = package_reads(keys)
    for key, (module, text, how) in CONSUMED_ELSEWHERE.items():
        assert key in keys, f"{key}: not a config key any more"
        assert key not in found, f"{key}: read at {found[key][:3]}, the table need not list it"
        assert text in (ROOT / module).read_text(), f"{key}: {module} no longer holds {text!r} ({how})"


def test_the_checker_misses_a_key_nothing_reads_and_finds_each_form_of_read():
    made_up = "rollout.nobody_reads_this"
    keys = set(all_keys()) | {made_up, "model.lora.nobody_either"}
    assert made_up not in package_reads(keys)  # the real code: it would be reported
    forms = {
        "chain": "def f(cfg):\n    return cfg.rollout.nobody_reads_this",
        "self_cfg": "class T:\n    def f(self):\n        return self.cfg.rollout.nobody_reads_this",
        "alias": "def f(cfg):\n    rc = cfg.rollout\n    return rc.nobody_reads_this",
        "tuple_alias": "def f(cfg):\n    ec, rc = cfg.engine, cfg.rollout\n    return rc.nobody_reads_this",
        "alias_of_alias": "def f(cfg):\n    m = cfg.model\n    lo = m.lora\n    return lo.nobody_either",
        "closure": "def f(cfg):\n    rc = cfg.rollout\n    def g():\n        return rc.nobody_reads_this\n"
                   "    return g",
        "annotated": "def f(rc: RolloutConfig):\n    return rc.nobody_reads_this",
        "annotated_optional": "def f(lc: LoraConfig | None):\n    return lc.nobody_either",
        "getattr": "def f(cfg):\n    return getattr(cfg.rollout, 'nobody_reads_this')",
        "annotated_assign": "def f(self):\n    rc: RolloutConfig = self.config\n"
                            "    return rc.nobody_reads_this",
        "or": "def f(cfg, r=None):\n    x = r or cfg.rollout\n    return x.nobody_reads_this",
    }
    for name, text in forms.items():
        found = reads({name: text}, keys)
        assert made_up in found or "model.lora.nobody_either" in found, name
    not_reads = {
        "other_section": "def f(cfg):\n    return cfg.optim.nobody_reads_this",
        "not_a_config": "def f(x):\n    return x.rollout.nobody_reads_this",
        "alias_elsewhere": "def f(cfg):\n    rc = cfg.rollout\ndef g(rc):\n    return rc.nobody_reads_this",
        "a_string": "X = 'cfg.rollout.nobody_reads_this'",
        "section_only": "def f(cfg):\n    return cfg.rollout",
    }
    for name, text in not_reads.items():
        assert reads({name: text}, keys) == {}, name
    # through a property of the config: read when the property is, not when it is only defined
    config = ("class TrainConfig:\n    @property\n    def busy(self):\n        return self.helper()\n"
              "    def helper(self):\n        return self.rollout.nobody_reads_this > 0\n")
    derived = config_properties(config, keys)
    assert derived[("", "busy")] == {made_up}
    assert made_up in reads({"use": "def f(cfg):\n    return cfg.busy"}, keys, derived)
    assert reads({"no_use": "def f(cfg):\n    return cfg.idle"}, keys, derived) == {}


# ---------------------------------------------------------------------------- rollout.top_p
def vllm(**rollout):
    return build_config({"engine": {"kind": "vllm", "base_url": "http://127.0.0.1:9"},
                         "rollout": rollout})


def test_top_p_below_1_is_refused_where_the_engine_records_other_logprobs():
    check_top_p(build_config({"rollout": {"top_p": 0.5}}))  # the local engine: honoured
    check_top_p(vllm(top_p=1.0))
    with pytest.raises(ConfigError, match=r"config key 'rollout\.top_p'.*engine\.kind 'vllm'"):
        check_top_p(vllm(top_p=0.9))
    with pytest.raises(ConfigError, match=r"config key 'rollout\.top_p'.*backend 'verl'"):
        check_top_p(build_config({"backend": "verl", "rollout": {"top_p": 0.9}}))
    # the ratio against the trainer's own logprobs: the engine's only feed the logged gap
    on_trainer = vllm(top_p=0.9).model_copy(update={"correction": build_config(
        {"correction": {"old": "trainer"}}).correction})
    check_top_p(on_trainer)
    corrected = build_config({"correction": {"old": "trainer", "weight": "token"}}).correction
    with pytest.raises(ConfigError, match=r"rollout\.top_p"):
        check_top_p(vllm(top_p=0.9).model_copy(update={"correction": corrected}))
    # and the collect stage refuses before any agent starts (no gateway is needed to see it)
    with pytest.raises(ConfigError, match=r"rollout\.top_p"):
        asyncio.run(collect(None, [], None, vllm(top_p=0.9), temperature=1.0, step=0))


def test_the_trainer_refuses_top_p_before_any_work(tmp_path):
    """Before the warm start, the engine's launch and the interpreter check (a missing one)."""
    from tracetrain.run.trainer import Trainer

    cfg = build_config({"engine": {"kind": "vllm", "python": str(tmp_path / "no-python")},
                        "rollout": {"top_p": 0.9}, "trainer": {"run_dir": str(tmp_path / "run")},
                        "warm_start": {"steps": 50}})
    trainer = Trainer(cfg, load_example("guess"))
    with pytest.raises(ConfigError, match=r"config key 'rollout\.top_p'"):
        asyncio.run(trainer.run())
    assert not (tmp_path / "run" / "config.json").exists()  # the run directory was not claimed


class SpyEngine(FakeEngine):
    """FakeEngine that keeps the SamplingParams of each call."""

    def __init__(self):
        super().__init__(reply=lambda k, prompt: "5")
        self.params = []

    async def generate(self, prompt_ids, params, on_tokens=None):
        self.params.append(params)
        return await super().generate(prompt_ids, params, on_tokens)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_task", ROOT / "examples" / name / "task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("top_p", [0.3, 1.0])
def test_rollout_top_p_goes_from_the_config_through_the_agents_to_the_engine(tmp_path, top_p):
    """The collect stage hands rollout.top_p to each agent (client["top_p"], as temperature); the
    example agent passes it to the SDK, the gateway to the engine's SamplingParams."""
    cfg = build_config({"rollout": {"top_p": top_p, "temperature": 0.7, "max_tokens": 4}})
    specs = rollout_specs([{"target": 3, "high": 8, "max_turns": 2}], 2, "s0")
    seen = []
    guess = load_example("guess")

    async def agent(task, client):
        seen.append(client["top_p"])
        return await guess.agent(task, client)

    engine = SpyEngine()
    with live_gateway(tmp_path, engine) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            try:
                return await collect(client, specs, agent, cfg, temperature=0.7, step=0)
            finally:
                await client.aclose()

        results = asyncio.run(main())
    assert [r.state for r in results] == ["succeeded"] * 2
    assert seen == [top_p] * 2
    assert len(engine.params) == 4  # 2 rollouts x 2 turns (the engine guesses 5, the target is 3)
    assert {(p.top_p, p.temperature) for p in engine.params} == {(top_p, 0.7)}


def test_a_command_agent_gets_top_p_in_its_sampling_variable(tmp_path):
    out = tmp_path / "sampling.json"
    code = f"import os; open({str(out)!r}, 'w').write(os.environ['TRACETRAIN_SAMPLING'])"
    agent = CommandAgent([sys.executable, "-c", code])
    client = {"base_url": "http://127.0.0.1:9/v1", "api_key": "k", "model": "policy",
              "rollout_id": "r", "rollout_url": "http://127.0.0.1:9", "temperature": 0.7,
              "top_p": 0.3, "max_tokens": 4}
    asyncio.run(agent({}, client))
    assert json.loads(out.read_text()) == {"temperature": 0.7, "top_p": 0.3, "max_tokens": 4}
