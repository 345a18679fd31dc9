"""The write operations, each run by the group commit inside its transaction (first argument:
the write connection): rollouts (create, rekey, state, start, reward override, delete), turns,
turn rewards, events, engines."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence

from tracetrain.store.records import (
    EventRecord,
    IllegalTransition,
    NewRollout,
    NewTurn,
    RolloutConflict,
    RolloutEnded,
    RolloutRecord,
    TurnReward,
    UnknownRollout,
    UnknownTurn,
    floats_to_blob,
    ids_to_blob,
)
from tracetrain.store.schema import _ROLLOUT_COLUMNS, _rollout
from tracetrain.types import DEFAULT_ROLE, LEGAL_TRANSITIONS, TERMINAL_STATES, RolloutState


def _now() -> float:
    return time.time()


def _get(conn: sqlite3.Connection, rollout_id: str) -> RolloutRecord:
    row = conn.execute(
        f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ?", (rollout_id,)
    ).fetchone()
    if row is None:
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")
    return _rollout(row)


def _op_create(conn, rollouts: Sequence[NewRollout]) -> list[tuple[RolloutRecord, bool]]:
    out = []
    now = _now()
    for r in rollouts:
        task = json.dumps(r.task, allow_nan=False, separators=(",", ":"))
        row = conn.execute(
            f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ?", (r.rollout_id,)
        ).fetchone()
        if row is not None:
            old = _rollout(row)
            if (old.group_id, old.task, old.engine) != (r.group_id, json.loads(task), r.engine):
                raise RolloutConflict(
                    f"rollout {r.rollout_id!r} already exists with a different group_id, task or "
                    "engine; creating with an existing id is only allowed with the same values"
                )
            out.append((old, False))
            continue
        conn.execute(
            "INSERT INTO rollouts (rollout_id, group_id, task, engine, state, key_salt, key_hash,"
            " created_at, updated_at) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?)",
            (r.rollout_id, r.group_id, task, r.engine, r.key_salt, r.key_hash, now, now),
        )
        out.append((_get(conn, r.rollout_id), True))
    return out


def _op_rekey(conn, rollout_id: str, key_salt: bytes, key_hash: bytes) -> None:
    cur = conn.execute(
        "UPDATE rollouts SET key_salt = ?, key_hash = ?, updated_at = ? WHERE rollout_id = ?",
        (key_salt, key_hash, _now(), rollout_id),
    )
    if cur.rowcount == 0:
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")


def _op_set_state(conn, rollout_id: str, state: RolloutState, error: str | None) -> RolloutRecord:
    old = _get(conn, rollout_id)
    if state == old.state:
        return old
    if state not in LEGAL_TRANSITIONS[old.state]:
        allowed = ", ".join(sorted(s.value for s in LEGAL_TRANSITIONS[old.state])) or "none"
        raise IllegalTransition(
            f"rollout {rollout_id!r} cannot go from {old.state.value} to {state.value} "
            f"(allowed from {old.state.value}: {allowed})"
        )
    conn.execute(
        "UPDATE rollouts SET state = ?, error = COALESCE(?, error), updated_at = ? "
        "WHERE rollout_id = ?",
        (state.value, error, _now(), rollout_id),
    )
    return _get(conn, rollout_id)


def _check_open(rollout: RolloutRecord, what: str) -> None:
    if rollout.state in TERMINAL_STATES:
        raise RolloutEnded(
            f"rollout {rollout.rollout_id!r} has ended ({rollout.state.value}); no more {what}"
        )


def _op_start(conn, rollout_id: str) -> RolloutRecord:
    r = _get(conn, rollout_id)
    _check_open(r, "model calls")
    if r.state == RolloutState.queued:
        conn.execute(
            "UPDATE rollouts SET state = 'running', updated_at = ? WHERE rollout_id = ?",
            (_now(), rollout_id),
        )
        r = _get(conn, rollout_id)
    return r


def _op_add_turn(conn, rollout_id: str, turn: NewTurn) -> int:
    """A turn; with `prompt_from` = k only the prompt ids after turn k's prompt + response ids
    (`reused_tokens` of them) are stored, once that length is checked against turn k."""
    prompt_ids, prompt_from = turn.prompt_ids, turn.prompt_from
    row = conn.execute(
        "SELECT state, n_turns FROM rollouts WHERE rollout_id = ?", (rollout_id,)
    ).fetchone()
    if row is None:
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")
    state, index = RolloutState(row[0]), row[1]
    if state in TERMINAL_STATES:
        raise RolloutEnded(f"rollout {rollout_id!r} has ended ({state.value}); no more turns")
    stored = prompt_ids
    if prompt_from is not None:
        reused = turn.reused_tokens
        earlier = conn.execute(
            "SELECT COALESCE(prompt_len, length(prompt_ids) / 4) + length(response_ids) / 4"
            " FROM turns WHERE rollout_id = ? AND idx = ?",
            (rollout_id, prompt_from),
        ).fetchone()
        if earlier is None or earlier[0] != reused or reused > len(prompt_ids):
            raise ValueError(
                f"turn {index} of rollout {rollout_id!r}: prompt_from={prompt_from} with "
                f"reused_tokens={reused}, but that turn "
                + ("does not exist" if earlier is None else f"holds {earlier[0]} ids")
            )
        stored = prompt_ids[reused:]
    now, tools = _now(), turn.tools
    conn.execute(
        "INSERT INTO turns (rollout_id, idx, prompt_ids, response_ids, logprobs, model_version,"
        " finish_reason, created_at, context, context_reason, reused_tokens, prompt_from,"
        " prompt_len, role, messages, tool_calls, tool_parse_failures, tool_unknown)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            rollout_id,
            index,
            ids_to_blob(stored),
            ids_to_blob(turn.response_ids),
            None if turn.response_logprobs is None else floats_to_blob(turn.response_logprobs),
            turn.model_version,
            turn.finish_reason,
            now,
            turn.context,
            turn.context_reason,
            turn.reused_tokens,
            prompt_from,
            len(prompt_ids),
            None if turn.role == DEFAULT_ROLE else turn.role,
            turn.messages.decode() if isinstance(turn.messages, bytes) else turn.messages,
            *((None,) * 3 if tools is None else (tools.calls, tools.parse_failures, tools.unknown)),
        ),
    )
    if state == RolloutState.running:  # state is indexed: leave it, and its index page, alone
        conn.execute(
            "UPDATE rollouts SET n_turns = ?, updated_at = ? WHERE rollout_id = ?",
            (index + 1, now, rollout_id),
        )
    else:
        conn.execute(
            "UPDATE rollouts SET n_turns = ?, state = 'running', updated_at = ?"
            " WHERE rollout_id = ?",
            (index + 1, now, rollout_id),
        )
    return index


def _op_add_event(conn, rollout_id, kind, payload, reward, allow_ended) -> EventRecord:
    r = _get(conn, rollout_id)
    if not allow_ended:
        _check_open(r, "events from the agent")
    now = _now()
    cur = conn.execute(
        "INSERT INTO events (rollout_id, kind, payload, reward, created_at) VALUES (?, ?, ?, ?, ?)",
        (
            rollout_id,
            kind,
            json.dumps(payload, allow_nan=False, separators=(",", ":")),
            reward,
            now,
        ),
    )
    if kind == "reward":
        conn.execute(
            "UPDATE rollouts SET reward_event = ?, updated_at = ? WHERE rollout_id = ?",
            (reward, now, rollout_id),
        )
    return EventRecord(cur.lastrowid, rollout_id, kind, payload, reward, now)


def _op_add_turn_reward(conn, rollout_id, reward, turn, name) -> TurnReward:
    """A reward for turn `turn` of a running rollout (None: its latest turn)."""
    r = _get(conn, rollout_id)
    _check_open(r, "turn rewards")
    if r.n_turns == 0:
        raise UnknownTurn(f"rollout {rollout_id!r} has no turn yet to give a reward to")
    if turn is None:
        turn = r.n_turns - 1
    elif not 0 <= turn < r.n_turns:
        raise UnknownTurn(
            f"rollout {rollout_id!r} has no turn {turn}: its turns are 0..{r.n_turns - 1}"
        )
    now = _now()
    cur = conn.execute(
        "INSERT INTO turn_rewards (rollout_id, turn, name, reward, created_at)"
        " VALUES (?, ?, ?, ?, ?)",
        (rollout_id, turn, name, reward, now),
    )
    return TurnReward(cur.lastrowid, rollout_id, turn, reward, name, now)


def _op_set_override(conn, rollout_id: str, reward: float | None) -> RolloutRecord:
    cur = conn.execute(
        "UPDATE rollouts SET reward_override = ?, updated_at = ? WHERE rollout_id = ?",
        (reward, _now(), rollout_id),
    )
    if cur.rowcount == 0:
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")
    return _get(conn, rollout_id)


def _op_delete(conn, rollout_id: str) -> bool:
    return conn.execute("DELETE FROM rollouts WHERE rollout_id = ?", (rollout_id,)).rowcount > 0


def _op_put_engine(conn, name: str, spec: dict) -> None:
    conn.execute(
        "INSERT INTO engines (name, spec, created_at) VALUES (?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec",
        (name, json.dumps(spec, allow_nan=False), _now()),
    )
