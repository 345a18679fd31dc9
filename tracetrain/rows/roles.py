"""Roles: which agent of a program made each call, and which of them train.

A rollout may hold the calls of several roles (a solver and a checker, a planner and an executor);
the gateway records each turn's role (types.Turn.role). The run's config names the roles that train
(`roles.train`; None: every role). A role that does not train is still served and recorded, and
counted here, but contributes no trained token: aggregate builds rows from the trained roles'
turns only, each role's turns chaining by their own prefix (another role's call in between does
not break a role's chain), so adding calls of a role that does not train changes no row.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tracetrain.types import Rollout, Turn


def trains(role: str, train_roles: Collection[str] | None) -> bool:
    """Whether turns of `role` are trained (every role when train_roles is None)."""
    return train_roles is None or role in train_roles


def role_orders(turns: Sequence[Turn], train_roles: Collection[str] | None) -> list[list[int]]:
    """The turn indices of each trained role, in turn order; roles in order of their first call.

    One role (the usual agent) gives [[0, 1, ..., n-1]]: the rows are those of a rollout without
    roles."""
    orders: dict[str, list[int]] = {}
    for k, t in enumerate(turns):
        if trains(t.role, train_roles):
            orders.setdefault(t.role, []).append(k)
    return list(orders.values())


def role_engines(serve: dict[str, str], policy: str = "default") -> dict[str, str]:
    """roles.serve as the gateway's role -> engine slot map (`policy` is the policy's slot)."""
    return {role: policy if engine == "policy" else engine for role, engine in serve.items()}


def role_metrics(rollouts: Sequence[Rollout], train_roles: Collection[str] | None) -> dict[str, float]:
    """Per role: roles/<role>/turns, roles/<role>/response_tokens, roles/<role>/trained (1 or 0);
    turn rewards: turn_rewards/count, turn_rewards/mean (0 when there are none), and per role
    roles/<role>/turn_reward_mean over its turns that were given one."""
    turns: dict[str, int] = {}
    tokens: dict[str, int] = {}
    rewarded: dict[str, list[float]] = {}
    for r in rollouts:
        for t in r.turns:
            turns[t.role] = turns.get(t.role, 0) + 1
            tokens[t.role] = tokens.get(t.role, 0) + len(t.response_ids)
            if t.reward is not None:
                rewarded.setdefault(t.role, []).append(float(t.reward))
    out: dict[str, float] = {}
    for role in turns:
        out[f"roles/{role}/turns"] = turns[role]
        out[f"roles/{role}/response_tokens"] = tokens[role]
        out[f"roles/{role}/trained"] = float(trains(role, train_roles))
        if role in rewarded:
            out[f"roles/{role}/turn_reward_mean"] = sum(rewarded[role]) / len(rewarded[role])
    given = [x for xs in rewarded.values() for x in xs]
    out["turn_rewards/count"] = len(given)
    out["turn_rewards/mean"] = sum(given) / len(given) if given else 0.0
    return out
