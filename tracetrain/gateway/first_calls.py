"""Which roles of each rollout have made a chat call, so that a role's first call (context reason
first_turn) is told from a call whose earlier turns the gateway no longer holds (forgotten),
without a store read on every call. A role's first call may come at any point of a rollout (a
checker called after the solver's turns, served by another engine).

    calls = RoleCalls(store)
    await calls.first(rollout, role)   True: `role` has made no chat call in this rollout yet
    calls.made(rollout_id, role)       a chat turn of `role` was recorded

A rollout is known from its first call on (a queued rollout has made none); one not known (the
gateway restarted since its first call, or it fell out of the bounded memory) is read from the
store once: the roles of its chat turns (a raw text completion has no chat context).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from tracetrain.store import RolloutHead, Store
from tracetrain.types import RolloutState

MAX_ROLLOUTS = 1 << 15  # rollouts remembered (LRU); one forgotten is read again when it calls


class RoleCalls:
    """Not thread-safe: one per gateway, used on its event loop."""

    def __init__(self, store: Store, *, max_rollouts: int = MAX_ROLLOUTS):
        self.store, self.max_rollouts = store, max_rollouts
        self._roles: OrderedDict[str, tuple[str, ...]] = OrderedDict()

    async def first(self, rollout: RolloutHead, role: str) -> bool:
        """Whether this call is `role`'s first chat call in the rollout."""
        rid = rollout.rollout_id
        roles = self._roles.get(rid)
        if roles is not None:
            self._roles.move_to_end(rid)
            return role not in roles
        if rollout.state == RolloutState.queued:
            found: tuple[str, ...] = ()
        else:  # called before, by a gateway process that did not tell this one
            turns = await asyncio.to_thread(self.store.get_turns, rid)
            found = tuple({t.role: None for t in turns if t.context is not None})
        roles = tuple({r: None for r in (*found, *self._roles.get(rid, ()))})  # + calls meanwhile
        self._roles[rid] = roles
        self._roles.move_to_end(rid)
        while len(self._roles) > self.max_rollouts:
            self._roles.popitem(last=False)
        return role not in roles

    def made(self, rollout_id: str, role: str) -> None:
        """Note a recorded chat turn of `role` (a rollout not known stays unknown: `first` reads
        all of its roles at once)."""
        roles = self._roles.get(rollout_id)
        if roles is not None and role not in roles:
            self._roles[rollout_id] = (*roles, role)
