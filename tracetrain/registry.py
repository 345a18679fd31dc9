"""Names a config can choose: one registry per config key, filled by the stages that own the pieces.

    ESTIMATORS = Registry("advantage.estimator", "advantage estimator",   # declared here
                          "tracetrain.objective.advantage")               # its home module
    @ESTIMATORS.register("grpo")            # in the home module (objective/advantage.py)
    def grpo(rewards, group, n_groups, eps): ...
    ESTIMATORS["grpo"], "grpo" in ESTIMATORS, list(ESTIMATORS)     # a read-only mapping
    ESTIMATORS.resolve("per_rollout_mean")  # the registered name an alias stands for; a name that
                                            # is neither: ValueError listing the known names

A registry is declared here, at the bottom of the package, so the config (which sits below the
stages) can validate a key against it: `names()` first imports the registry's `home` modules,
where the built-in pieces register, so the names are complete however little of the package a
process has imported. A user's own pieces register from the modules the config's `plugins` key
names (`import_plugins`), imported before the config is validated, in every process that builds
a config (the trainer, each DDP rank, the viewer; agent workers build none and need none).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tracetrain.paths import near_config, not_found

F = TypeVar("F")


class Registry(Mapping[str, Any]):
    """name -> piece (a `what`) for the config key `key`, the built-in pieces registered by the
    modules `home`; `aliases` map other names to registered ones."""

    def __init__(self, key: str, what: str, *home: str,
                 aliases: Mapping[str, str] | None = None) -> None:
        self.key, self.what, self.home = key, what, home
        self.aliases = dict(aliases or {})
        self._entries: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """A decorator that registers its function or class under `name`. A name taken by another
        piece is an error (two plugins choosing one name would otherwise replace each other)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.key}: a registered name is a non-empty str, got {name!r}")

        def add(piece: F) -> F:
            old = self._entries.get(name)
            if old is not None and _qualname(old) != _qualname(piece):
                raise ValueError(f"{self.key}: {name!r} is registered already ({_qualname(old)})")
            if name in self.aliases:
                raise ValueError(f"{self.key}: {name!r} is an alias of {self.aliases[name]!r}")
            self._entries[name] = piece
            return piece

        return add

    def names(self) -> list[str]:
        """The registered names then the aliases, after importing the home modules."""
        for module in self.home:
            if module not in sys.modules:
                importlib.import_module(module)
        return [*self._entries, *self.aliases]

    def builtin(self) -> list[str]:
        """The names the home modules register (not a plugin's), then the aliases."""
        self.names()
        return [*(n for n, p in self._entries.items() if getattr(p, "__module__", None) in self.home),
                *self.aliases]

    def resolve(self, name: str) -> str:
        """The registered name `name` is or stands for; ValueError naming the key and listing every
        known name (aliases included) when it is neither."""
        known = self.names()
        if name in self._entries:
            return name
        if name in self.aliases:
            return self.aliases[name]
        raise ValueError(f"{self.key}: unknown {self.what} {name!r}; known: {', '.join(known)}")

    def __getitem__(self, name: str) -> Any:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.key!r}: {', '.join(self._entries)})"


def _qualname(piece: Any) -> str:
    return f"{getattr(piece, '__module__', '?')}.{getattr(piece, '__qualname__', repr(piece))}"


# The registries, by the config key that chooses from each.
ADVANTAGE_ESTIMATORS = Registry("advantage.estimator", "advantage estimator",
                                "tracetrain.objective.advantage")
"""Rollout-level estimators: fn(rewards [n], group [n], n_groups, eps) -> advantages [n]."""
TURN_ESTIMATORS = Registry("advantage.estimator", "turn-level advantage estimator",
                           "tracetrain.objective.credit")
"""Turn-level estimators (objective/credit.py): one advantage per trained turn."""
LOSS_MODES = Registry("loss.mode", "loss aggregation mode", "tracetrain.objective.weights",
                      aliases={"per_rollout_mean": "rollout-mean"})  # Agent Lightning's name
"""Token-weight modes: fn(T_i [rows], rollout inverse [rows], R, norm_length) -> s_i [rows]."""
KL_ESTIMATORS = Registry("loss.kl_estimator", "KL estimator", "tracetrain.objective.loss")
"""KL estimators: fn(logprob [rows, S], ref [rows, S]) -> kl [rows, S]."""
CORRECTION_WEIGHTS = Registry("correction.weight", "correction weight",
                              "tracetrain.objective.correction")
"""Importance weights: fn(log ratios, rollout index [rows], cap) -> v [rows, S]."""
CORRECTION_MASKS = Registry("correction.mask", "correction mask", "tracetrain.objective.correction")
"""Importance masks: fn(log ratios, rollout index [rows], band) -> keep [rows, S]."""
ENGINE_KINDS = Registry("engine.kind", "engine kind", "tracetrain.engines.start")
"""Engine starters: async fn(cfg, weights, tokenizer, *, version, run_dir, threads, log)."""
ENV_KINDS = Registry("env.kind", "environment kind", *(
    f"tracetrain.envs.{m}" for m in ("reasoning_gym", "verifiers_env", "environment_class", "openenv")))
"""Environment adapters (envs/base.py's Environment): cls(the config's `env` section); the
package tracetrain.envs imports these modules in this order (so the kinds have one order)."""

KEYS: dict[str, tuple[Registry, ...]] = {}
"""Config key -> the registries whose names it accepts (advantage.estimator: both levels)."""
for _r in (ADVANTAGE_ESTIMATORS, TURN_ESTIMATORS, LOSS_MODES, KL_ESTIMATORS, CORRECTION_WEIGHTS,
           CORRECTION_MASKS, ENGINE_KINDS, ENV_KINDS):
    KEYS[_r.key] = (*KEYS.get(_r.key, ()), _r)


def resolve(key: str, name: str) -> str:
    """The registered name that `name` chooses for config key `key` (an alias resolved); a name no
    registry of the key knows: ValueError listing every known one."""
    registries = KEYS[key]
    for r in registries:
        if name in r.names():
            return r.resolve(name)
    raise ValueError(f"{key}: unknown {registries[0].what} {name!r}; known: {', '.join(known(key))}")


def known(key: str, *, builtin: bool = False) -> list[str]:
    """Every name config key `key` accepts, aliases included (`builtin`: tracetrain's own only)."""
    return [n for r in KEYS[key] for n in (r.builtin() if builtin else r.names())]


def import_plugins(modules: list[str], base_dir: str | Path | None = None) -> list[str]:
    """Import each of `modules` so that it registers its pieces: a module name, or a .py file
    (absolute, else relative to `base_dir`, then the working directory), imported once per
    process (a file under a name made from its resolved path). Returns `modules` with each file
    as its absolute path. ValueError naming the module when it cannot be found; an error of the
    module's own code is raised as an ImportError naming the module, from that error."""
    out = []
    for spec in modules:
        if spec.endswith(".py"):
            path = near_config(spec, base_dir, Path.is_file)
            if path is None:
                raise ValueError(f"plugins: {not_found(spec, base_dir)}")
            path = path.resolve()
            name = f"tracetrain_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
            found = importlib.util.spec_from_file_location(name, path)
            out.append(str(path))
        else:
            name = spec
            try:
                found = importlib.util.find_spec(spec)
            except ImportError:  # a parent package that does not exist
                found = None
            if found is None:
                raise ValueError(f"plugins: no module named {spec!r} (is it on sys.path?)")
            out.append(spec)
        if name in sys.modules:
            continue
        module = importlib.util.module_from_spec(found)
        sys.modules[name] = module
        try:
            found.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise ImportError(f"plugins: importing {spec!r} failed: {e!r}") from e
    return out
