"""The store's contract (`Store`): async writes that return after commit, plain reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

from tracetrain.store.records import (
    EventRecord,
    NewRollout,
    NewTurn,
    RolloutHead,
    RolloutRecord,
    TurnRecord,
    TurnReward,
    UnknownRollout,
)
from tracetrain.types import TERMINAL_STATES, Rollout, RolloutState, Turn


class Store(ABC):
    """Durable rollouts, turns and events. Writes return after commit; reads are synchronous."""

    # writes
    @abstractmethod
    async def create_rollouts(
        self, rollouts: Sequence[NewRollout]
    ) -> list[tuple[RolloutRecord, bool]]:
        """Insert each rollout unless its id exists (then: same group/task/engine -> returned with
        created=False; different -> RolloutConflict, and nothing of the batch is written)."""

    @abstractmethod
    async def rekey_rollout(self, rollout_id: str, key_salt: bytes, key_hash: bytes) -> None: ...

    @abstractmethod
    async def set_state(
        self, rollout_id: str, state: RolloutState | str, error: str | None = None
    ) -> RolloutRecord:
        """Move a rollout to `state` if LEGAL_TRANSITIONS allows (setting the current state again
        is a no-op); IllegalTransition otherwise."""

    @abstractmethod
    async def start(self, rollout_id: str) -> RolloutRecord:
        """queued -> running; a running rollout is returned as is; RolloutEnded if terminal."""

    @abstractmethod
    async def add_turn(self, rollout_id: str, turn: NewTurn) -> int:
        """Append `turn` to the rollout and return its index (0, 1, ...: dense, in the order the
        writes reached the store). A queued rollout becomes running; UnknownRollout if there is
        no such rollout, RolloutEnded if it is terminal. What is kept of each field: NewTurn."""

    @abstractmethod
    async def add_turn_reward(
        self, rollout_id: str, reward: float, turn: int | None = None, name: str | None = None
    ) -> TurnReward:
        """Give turn `turn` (None: the latest) of a rollout that has not ended a reward (finite,
        checked by the caller); UnknownTurn if it has no such turn, RolloutEnded if it ended.
        A turn may get several; its reward is their sum (TurnRecord.reward)."""

    @abstractmethod
    async def add_event(
        self,
        rollout_id: str,
        kind: str,
        payload: Any = None,
        reward: float | None = None,
        *,
        allow_ended: bool = True,
    ) -> EventRecord:
        """Append an event; kind "reward" carries `reward`, which becomes the rollout's reward."""

    @abstractmethod
    async def set_reward_override(self, rollout_id: str, reward: float | None) -> RolloutRecord: ...

    @abstractmethod
    async def delete_rollout(self, rollout_id: str) -> bool: ...

    @abstractmethod
    async def put_engine(self, name: str, spec: dict[str, Any]) -> None: ...

    # reads
    @abstractmethod
    def get_rollout(self, rollout_id: str) -> RolloutRecord | None: ...

    @abstractmethod
    def get_head(self, rollout_id: str) -> RolloutHead | None: ...

    @abstractmethod
    def head_by_key_hash(self, key_hash: bytes) -> RolloutHead | None:
        """The rollout whose key hashes to `key_hash` (the key lookup of every agent request)."""

    @abstractmethod
    def get_turns(self, rollout_id: str) -> list[TurnRecord]: ...

    @abstractmethod
    def get_turn_rewards(self, rollout_id: str) -> list[TurnReward]:
        """A rollout's turn rewards, by turn, in the order they were given."""

    @abstractmethod
    def turn_contexts(self, rollout_ids: Iterable[str]) -> list[tuple[str | None, str | None, int]]:
        """(context, context_reason, reused_tokens) of every turn of these rollouts."""

    @abstractmethod
    def list_rollouts(
        self,
        *,
        state: RolloutState | str | None = None,
        group_id: str | None = None,
        after: int = 0,
        limit: int = 100,
        group_glob: str | None = None,
    ) -> list[RolloutRecord]:
        """Rollouts with seq > `after`, in insertion order, at most `limit`; `group_glob`: only
        groups whose id matches this pattern (SQLite GLOB: `*`, `?`, `[...]`, case-sensitive)."""

    @abstractmethod
    def list_events(self, rollout_id: str, kind: str | None = None) -> list[EventRecord]: ...

    @abstractmethod
    def list_engines(self) -> dict[str, dict[str, Any]]: ...

    def load_rollouts(
        self,
        *,
        rollout_ids: Iterable[str] | None = None,
        group_id: str | None = None,
        states: Iterable[RolloutState | str] = TERMINAL_STATES,
    ) -> list[Rollout]:
        """Finished rollouts as `tracetrain.types.Rollout` (validated), for the trainer."""
        wanted = {RolloutState(s) for s in states}
        if rollout_ids is not None:
            rollout_ids = list(rollout_ids)
            records = [self.get_rollout(i) for i in rollout_ids]
            missing = [i for i, r in zip(rollout_ids, records, strict=True) if r is None]
            if missing:
                raise UnknownRollout(f"unknown rollout ids: {missing[:10]}")
        else:
            records, after = [], 0
            while page := self.list_rollouts(group_id=group_id, after=after, limit=1000):
                records += page
                after = page[-1].seq
        out = []
        for r in records:
            if r.state not in wanted or (group_id is not None and r.group_id != group_id):
                continue
            out.append(Rollout(r.rollout_id, r.group_id, self.training_turns(r.rollout_id), r.reward,
                               r.state))
        return out

    def training_turns(self, rollout_id: str) -> list[Turn]:
        """A rollout's turns as validated `Turn`s, for the trainer."""
        return [t.to_turn() for t in self.get_turns(rollout_id)]

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
