"""The store: rollouts, their turns, rewards and events, durably, in one SQLite file.

Contract (`Store`): writes are `async` and return only after their transaction is committed, so a
gateway that answers 2xx after `await store.add_turn(rollout_id, NewTurn(...))` never loses an
acknowledged turn when its process is killed (`kill -9`). Reads are plain calls, cheap and safe
from any thread.

`SQLiteStore(path)` implements it:
- WAL journal, `synchronous=NORMAL` by default: a commit is in the WAL (the OS page cache) before
  it is acknowledged, which survives the death of the process; `synchronous="FULL"` also fsyncs
  the WAL on every commit, which survives power loss at the cost of one fsync per group commit.
- Group commit: the writes that coroutines of one event loop issue during one loop iteration are
  run together, each in its own SAVEPOINT (one refused write does not undo the others; a group
  of one needs none), committed once, then each caller's future is resolved. With NORMAL this
  happens inline on the loop (a WAL append is cheaper than a hand-off to a writer thread); with
  FULL the fsyncing commit runs in a worker thread. Checkpoints
  run in a background thread. Writes are serialised (one lock): a turn's index is `n_turns` of its
  rollout read and bumped inside the same transaction, so indices are dense, unique and in the
  order the writes reached the store.
- Reads use one read-only connection per thread; in WAL mode they never wait for the writer.
  The key lookup of every agent call (`head_by_key_hash`) is answered from memory after the first
  time (an indexed read takes WAL locks). The cache is kept right by this
  store's own writes (a state change, rekey or delete drops the rollout's entry; a turn marks it
  running), so it assumes what the gateway assumes: one process writes the file, through one
  `SQLiteStore`. (A change made past it is still caught where it matters: a turn for a rollout
  that ended or is gone is refused inside its transaction.)
- Token ids are stored as little-endian int32 BLOBs and logprobs as little-endian float32 BLOBs
  (4 bytes per token; float32 keeps a logprob to ~1e-7 relative, the precision engines compute in).
  A prompt that continues an earlier turn of its rollout (the gateway's exact context:
  `NewTurn(..., prompt_from=k)`) is stored as the ids it adds to turn k's prompt + response, so
  a long conversation takes O(turns) bytes, not O(turns²); reads join it back.
- Schema versioned with `PRAGMA user_version`; `MIGRATIONS[k]` takes version k to k + 1; the
  pending ones run in one transaction (a reader never sees a store half created).

A rollout's reward is its `reward_override` when the trainer set one, else the value of its last
`reward` event, else None. Rewards given to turns while a rollout runs (`add_turn_reward`) are
kept per turn, beside it; a turn's reward is their sum. Each turn records its role.

Modules: `records` (errors, records, BLOB encoding), `schema` (tables and migrations), `base` (the
`Store` contract), `writes` (the write operations), `group_commit`, `sqlite` (`SQLiteStore`).
"""

from tracetrain.store.base import Store
from tracetrain.store.records import (
    EventRecord,
    IllegalTransition,
    NewRollout,
    NewTurn,
    RolloutConflict,
    RolloutEnded,
    RolloutHead,
    RolloutRecord,
    StoreError,
    TurnRecord,
    TurnReward,
    UnknownRollout,
    UnknownTurn,
    blob_to_float_array,
    blob_to_floats,
    blob_to_id_array,
    blob_to_ids,
    floats_to_blob,
    ids_to_blob,
)
from tracetrain.store.schema import MIGRATIONS, SCHEMA_VERSION, migrate
from tracetrain.store.sqlite import SQLiteStore

__all__ = [
    "MIGRATIONS", "SCHEMA_VERSION", "EventRecord", "IllegalTransition", "NewRollout", "NewTurn",
    "RolloutConflict", "RolloutEnded", "RolloutHead", "RolloutRecord", "SQLiteStore", "Store",
    "StoreError", "TurnRecord", "TurnReward", "UnknownRollout", "UnknownTurn",
    "blob_to_float_array", "blob_to_floats", "blob_to_id_array", "blob_to_ids", "floats_to_blob",
    "ids_to_blob", "migrate",
]
