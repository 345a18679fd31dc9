"""The SQLite schema, its migrations (`MIGRATIONS[k]` takes version k to k + 1, recorded in
`PRAGMA user_version`), and how a connection is opened."""

from __future__ import annotations

import json
import sqlite3

from tracetrain.store.records import RolloutRecord, StoreError, StoreNotReady
from tracetrain.types import RolloutState

# -------------------------------------------------------------------------------- schema

_STATES = ", ".join(f"'{s.value}'" for s in RolloutState)

MIGRATIONS: list[str] = [
    # 0 -> 1
    f"""
    CREATE TABLE rollouts (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        rollout_id TEXT NOT NULL UNIQUE,
        group_id TEXT NOT NULL,
        task TEXT NOT NULL,                 -- JSON
        engine TEXT,                        -- engine name; NULL = the gateway's default
        state TEXT NOT NULL CHECK (state IN ({_STATES})),
        error TEXT,
        reward_event REAL,                  -- value of the last reward event
        reward_override REAL,               -- set by the trainer; wins over reward_event
        n_turns INTEGER NOT NULL DEFAULT 0,
        key_salt BLOB NOT NULL,
        key_hash BLOB NOT NULL UNIQUE,      -- sha256 of the rollout's key; the key is never stored
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX rollouts_by_state ON rollouts (state, seq);
    CREATE INDEX rollouts_by_group ON rollouts (group_id, seq);
    CREATE TABLE turns (
        rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        prompt_ids BLOB NOT NULL,           -- int32 little-endian
        response_ids BLOB NOT NULL,         -- int32 little-endian
        logprobs BLOB,                      -- float32 little-endian, one per response id
        model_version INTEGER,
        finish_reason TEXT,
        created_at REAL NOT NULL,
        PRIMARY KEY (rollout_id, idx)
    ) WITHOUT ROWID;
    CREATE TABLE events (
        event_id INTEGER PRIMARY KEY AUTOINCREMENT,
        rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id) ON DELETE CASCADE,
        kind TEXT NOT NULL,
        payload TEXT NOT NULL,              -- JSON
        reward REAL,
        created_at REAL NOT NULL
    );
    CREATE INDEX events_by_rollout ON events (rollout_id, event_id);
    CREATE TABLE engines (
        name TEXT PRIMARY KEY,
        spec TEXT NOT NULL,                 -- JSON: how to rebuild the engine
        created_at REAL NOT NULL
    );
    """,
    # 1 -> 2: how each turn's prompt was built (gateway/context.py)
    """
    ALTER TABLE turns ADD COLUMN context TEXT;          -- exact | rendered; NULL: a raw prompt
    ALTER TABLE turns ADD COLUMN context_reason TEXT;   -- why it was rendered in full
    ALTER TABLE turns ADD COLUMN reused_tokens INTEGER NOT NULL DEFAULT 0;
    """,
    # 2 -> 3: a prompt that continues an earlier turn keeps only what it adds
    """
    ALTER TABLE turns ADD COLUMN prompt_from INTEGER;   -- NULL: prompt_ids is the whole prompt;
        -- k: the prompt is turn k's prompt and response ids (reused_tokens of them), then prompt_ids
    ALTER TABLE turns ADD COLUMN prompt_len INTEGER;    -- the whole prompt's length (NULL before 3)
    """,
    # 3 -> 4: roles, and rewards given to turns while a rollout runs
    """
    ALTER TABLE turns ADD COLUMN role TEXT;             -- the agent that made the call; NULL: 'policy'
    CREATE TABLE turn_rewards (
        reward_id INTEGER PRIMARY KEY AUTOINCREMENT,
        rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id) ON DELETE CASCADE,
        turn INTEGER NOT NULL,              -- the turn's idx (checked to exist when written)
        name TEXT,
        reward REAL NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX turn_rewards_by_rollout ON turn_rewards (rollout_id, turn, reward_id);
    """,
    # 4 -> 5: the messages a chat turn was sent (for the viewer)
    """
    ALTER TABLE turns ADD COLUMN messages TEXT;         -- JSON list: the messages after those of
        -- the turn the prompt continues (prompt_from) and its answer; all of them otherwise;
        -- NULL: a raw prompt (no messages) or before 5
    """,
    # 5 -> 6: what each answer did with the tools it was offered (gateway/tool_calls.py tool_stats)
    """
    ALTER TABLE turns ADD COLUMN tool_calls INTEGER;    -- calls parsed; NULL: no tools offered
        -- (or calls not parsed: tool_choice none), or before 6
    ALTER TABLE turns ADD COLUMN tool_parse_failures INTEGER;  -- calls begun that did not parse
    ALTER TABLE turns ADD COLUMN tool_unknown INTEGER;  -- parsed calls of a tool not offered
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)

_ROLLOUT_COLUMNS = (
    "rollout_id, group_id, task, engine, state, error, "
    "COALESCE(reward_override, reward_event), reward_override, n_turns, created_at, updated_at, "
    "seq, key_salt, key_hash"
)


def _rollout(row: tuple) -> RolloutRecord:
    return RolloutRecord(row[0], row[1], json.loads(row[2]), row[3], RolloutState(row[4]), *row[5:])


def _connect(path: str, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode.lower() != "wal":
        raise StoreError(f"{path}: SQLite refused WAL mode (journal_mode is {mode!r})")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def _connect_read_only(path: str) -> sqlite3.Connection:
    """A connection that cannot write (SQLite's mode=ro): it reads the WAL beside a writer."""
    from urllib.parse import quote

    return sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, isolation_level=None,
                           check_same_thread=False, timeout=30.0)


READABLE_FROM = 4  # the oldest schema a read-only store reads as it is (later columns: NULL)


def check_readable(path: str) -> int:
    """The schema version of the trace store at `path`; StoreError naming it unless it is one
    this tracetrain reads without migrating (READABLE_FROM .. SCHEMA_VERSION)."""
    try:
        conn = _connect_read_only(path)
        try:
            conn.execute("BEGIN")  # the version and the tables from one snapshot
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0 and conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
                raise StoreNotReady(f"{path}: an empty file (a store being created?)")
            conn.execute("SELECT 1 FROM rollouts LIMIT 1")
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise StoreError(f"{path}: not a readable trace store ({e})") from None
    if not READABLE_FROM <= version <= SCHEMA_VERSION:
        raise StoreError(f"{path}: schema version {version}, this tracetrain reads "
                         f"{READABLE_FROM}..{SCHEMA_VERSION}"
                         + (": upgrade tracetrain" if version > SCHEMA_VERSION else
                            ": open it once for writing (e.g. `tracetrain inspect`) to migrate it"))
    return version


def migrate(conn: sqlite3.Connection, path: str = "") -> int:
    """Bring the schema to SCHEMA_VERSION: every pending migration in one transaction, so a
    reader sees the store before or after, never between (a new store: empty, then whole).
    Returns the version."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path}: schema version {version} is newer than this tracetrain knows "
            f"({SCHEMA_VERSION}); upgrade tracetrain"
        )
    if version < SCHEMA_VERSION:
        steps = ";\n".join(MIGRATIONS[v] for v in range(version, SCHEMA_VERSION))
        conn.executescript(
            f"BEGIN IMMEDIATE; {steps}; PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
        )
    return SCHEMA_VERSION
