"""SQLiteStore: round trips, legal transitions, rewards, group commit, migrations, crash safety."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    IllegalTransition,
    NewRollout,
    NewTurn,
    RolloutConflict,
    RolloutEnded,
    SQLiteStore,
    StoreError,
    UnknownRollout,
    blob_to_floats,
    blob_to_ids,
    floats_to_blob,
    ids_to_blob,
)
from tracetrain.types import LEGAL_TRANSITIONS, Rollout, RolloutState, ToolStats, TraceError, Turn

_ids = itertools.count()


def new(rollout_id=None, group_id="g", task=None, engine=None) -> NewRollout:
    rid = rollout_id or f"r{next(_ids)}"
    return NewRollout(rid, group_id, task, engine, b"salt-" + rid.encode(), b"hash-" + rid.encode())


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def store(tmp_path):
    s = SQLiteStore(tmp_path / "t.db")
    yield s
    s.close()


def test_create_is_idempotent_and_conflicts_are_atomic(store):
    ((rec, created),) = run(store.create_rollouts([new("a", task={"q": 1})]))
    assert created and rec.state == RolloutState.queued and rec.task == {"q": 1}
    ((again, created_again),) = run(store.create_rollouts([new("a", task={"q": 1})]))
    assert not created_again and again.seq == rec.seq
    # A batch holding a conflicting id writes nothing, not even its new rollouts.
    with pytest.raises(RolloutConflict, match="'a'"):
        run(store.create_rollouts([new("b"), new("a", task={"q": 2})]))
    assert store.get_rollout("b") is None
    assert store.get_rollout("a").task == {"q": 1}


def test_turns_round_trip_in_order(store):
    run(store.create_rollouts([new("a")]))
    lp = [-0.1, -2.5, -1e-9]
    i0 = run(store.add_turn("a", NewTurn([1, 2, 3], [4, 5, 2], lp, 7, "stop")))
    i1 = run(store.add_turn("a", NewTurn([1, 2, 3, 4, 5, 2, 9], [2**31 - 1], None, 8, "length")))
    assert (i0, i1) == (0, 1)
    rec = store.get_rollout("a")
    assert rec.state == RolloutState.running and rec.n_turns == 2  # first turn started it
    t0, t1 = store.get_turns("a")
    assert (t0.prompt_ids, t0.response_ids, t0.model_version, t0.finish_reason) == (
        [1, 2, 3],
        [4, 5, 2],
        7,
        "stop",
    )
    assert t0.response_logprobs == pytest.approx(lp, rel=1e-6, abs=1e-12)
    assert t1.response_ids == [2**31 - 1] and t1.response_logprobs is None


@st.composite
def continued_turns(draw):
    """Turns of one rollout, each (prompt, response, prompt_from): a turn either has a prompt of
    its own (prompt_from None) or continues an earlier one k: prompt(k) + response(k) + more."""
    ids = st.lists(st.integers(0, 2**31 - 1), max_size=12)
    turns = []
    for k in range(draw(st.integers(1, 8))):
        earlier = draw(st.none() | st.integers(0, k - 1)) if k else None
        if earlier is None:
            prompt = draw(ids.filter(bool))
        else:
            p, r, _ = turns[earlier]
            prompt = p + r + draw(ids)
        turns.append((prompt, draw(ids.filter(bool)), earlier))
    return turns


def test_a_continued_prompt_keeps_only_what_it_adds_and_reads_back_whole(tmp_path):
    with SQLiteStore(tmp_path / "c.db") as store:

        @settings(max_examples=60, deadline=None)
        @given(continued_turns())
        def check(turns):
            rid = f"c{next(_ids)}"
            run(store.create_rollouts([new(rid)]))
            for prompt, response, earlier in turns:
                reused = 0 if earlier is None else len(turns[earlier][0]) + len(turns[earlier][1])
                how = "exact" if earlier is not None else "rendered"
                turn = NewTurn(prompt, response, None, 0, "stop", context=how,
                               reused_tokens=reused, prompt_from=earlier)
                run(store.add_turn(rid, turn))
            got = store.get_turns(rid)
            assert [(t.prompt_ids, t.response_ids) for t in got] == [(p, r) for p, r, _ in turns]
            arrays = store.training_turns(rid)
            assert [list(t.prompt_ids) for t in arrays] == [p for p, _, _ in turns]
            conn = sqlite3.connect(tmp_path / "c.db")
            stored = conn.execute(
                "SELECT length(prompt_ids) / 4, prompt_from, prompt_len FROM turns"
                " WHERE rollout_id = ? ORDER BY idx", (rid,)
            ).fetchall()
            conn.close()
            for (n, frm, whole), (prompt, _, earlier), t in zip(stored, turns, got, strict=True):
                assert (frm, whole) == (earlier, len(prompt))
                assert n == len(prompt) - t.reused_tokens  # only the ids it adds

        check()


def test_a_continued_prompt_that_does_not_fit_its_earlier_turn_is_refused(store):
    run(store.create_rollouts([new("a")]))
    run(store.add_turn("a", NewTurn([1, 2, 3], [4, 5], None, 0, "stop")))
    with pytest.raises(ValueError, match="holds 5 ids"):  # claims 4 ids of turn 0, which has 5
        run(store.add_turn("a", NewTurn([1, 2, 3, 4, 9], [6], None, 0, "stop", context="exact",
                                        reused_tokens=4, prompt_from=0)))
    with pytest.raises(ValueError, match="does not exist"):
        run(store.add_turn("a", NewTurn([1, 2, 3, 4, 5, 9], [6], None, 0, "stop", context="exact",
                                        reused_tokens=5, prompt_from=3)))
    assert [t.prompt_ids for t in store.get_turns("a")] == [[1, 2, 3]]  # nothing else written


def test_turn_after_end_and_unknown_rollout_are_refused(store):
    run(store.create_rollouts([new("a")]))
    run(store.set_state("a", "running"))
    run(store.set_state("a", "succeeded"))
    with pytest.raises(RolloutEnded, match="succeeded"):
        run(store.add_turn("a", NewTurn([1], [2], None, 0, "stop")))
    with pytest.raises(RolloutEnded):
        run(store.start("a"))
    with pytest.raises(UnknownRollout, match="'nope'"):
        run(store.add_turn("nope", NewTurn([1], [2], None, 0, "stop")))
    assert store.get_turns("a") == [] and store.get_rollout("a").n_turns == 0


def test_state_machine_matches_legal_transitions(tmp_path):
    store = SQLiteStore(tmp_path / "sm.db")

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.sampled_from(list(RolloutState)), max_size=5))
    def check(targets):
        rid = f"sm{next(_ids)}"
        run(store.create_rollouts([new(rid)]))
        state = RolloutState.queued
        for target in targets:
            legal = target == state or target in LEGAL_TRANSITIONS[state]
            try:
                run(store.set_state(rid, target))
            except IllegalTransition as e:
                assert not legal and target.value in str(e)
            else:
                assert legal
                state = target
            assert store.get_rollout(rid).state == state

    try:
        check()
    finally:
        store.close()


def test_reward_is_last_reward_event_unless_overridden(store):
    run(store.create_rollouts([new("a")]))
    assert store.get_rollout("a").reward is None
    run(store.add_event("a", "reward", {"why": "first"}, reward=0.25))
    run(store.add_event("a", "note", {"x": 1}))
    run(store.add_event("a", "reward", None, reward=0.75))
    assert store.get_rollout("a").reward == 0.75
    run(store.set_reward_override("a", -1.0))
    assert store.get_rollout("a").reward == -1.0
    run(store.set_reward_override("a", None))
    assert store.get_rollout("a").reward == 0.75
    kinds = [(e.kind, e.reward, e.payload) for e in store.list_events("a")]
    assert kinds == [
        ("reward", 0.25, {"why": "first"}),
        ("note", None, {"x": 1}),
        ("reward", 0.75, None),
    ]
    run(store.set_state("a", "failed", "agent crashed"))
    with pytest.raises(RolloutEnded):  # an agent's event after the end is refused ...
        run(store.add_event("a", "reward", None, reward=1.0, allow_ended=False))
    run(store.add_event("a", "reward", None, reward=0.5))  # ... the trainer's is not
    assert store.get_rollout("a").reward == 0.5 and store.get_rollout("a").error == "agent crashed"


def test_list_pages_by_state_and_group(store):
    run(store.create_rollouts([new(f"p{i}", group_id=f"g{i % 3}") for i in range(10)]))
    for i in range(0, 10, 2):
        run(store.start(f"p{i}"))
    seen, after = [], 0
    while page := store.list_rollouts(state="running", after=after, limit=2):
        assert len(page) <= 2
        seen += [r.rollout_id for r in page]
        after = page[-1].seq
    assert seen == [f"p{i}" for i in range(0, 10, 2)]
    assert [r.rollout_id for r in store.list_rollouts(group_id="g1")] == ["p1", "p4", "p7"]


def test_delete_cascades(store):
    run(store.create_rollouts([new("a"), new("b")]))
    run(store.add_turn("a", NewTurn([1], [2], None, 0, "stop")))
    run(store.add_event("a", "reward", None, reward=1.0))
    assert run(store.delete_rollout("a")) and not run(store.delete_rollout("a"))
    assert store.get_rollout("a") is None and store.get_turns("a") == []
    assert store.list_events("a") == [] and store.get_rollout("b") is not None
    # The id can be used again, from scratch.
    run(store.create_rollouts([new("a")]))
    assert store.get_rollout("a").n_turns == 0


def test_concurrent_turns_are_dense_ordered_and_group_committed(store):
    n_rollouts, n_turns = 32, 15
    run(store.create_rollouts([new(f"c{i}") for i in range(n_rollouts)]))
    commits_before = store.commits

    async def agent(i):
        for k in range(n_turns):
            idx = await store.add_turn(f"c{i}", NewTurn([i, k], [k + 1], [-0.5], k, "stop"))
            assert idx == k

    async def main():
        await asyncio.gather(*(agent(i) for i in range(n_rollouts)))

    run(main())
    for i in range(n_rollouts):
        turns = store.get_turns(f"c{i}")
        assert [t.index for t in turns] == list(range(n_turns))
        assert [t.prompt_ids for t in turns] == [[i, k] for k in range(n_turns)]
    # Writes from concurrent coroutines shared commits.
    assert store.commits - commits_before < n_rollouts * n_turns


def test_a_refused_write_fails_alone_in_its_group_and_a_group_of_one_rolls_back(store):
    run(store.create_rollouts([new("ok"), new("over")]))
    run(store.set_state("over", "failed"))
    commits = store.commits

    async def group():  # issued in one loop iteration: one group, one commit
        return await asyncio.gather(
            store.add_turn("ok", NewTurn([1], [2], None, 0, "stop")),
            store.add_turn("over", NewTurn([1], [2], None, 0, "stop")),
            store.create_rollouts([new("fresh"), new("ok", task="other")]),  # conflict: none
            store.add_turn("ok", NewTurn([3], [4], None, 0, "stop")),
            return_exceptions=True,
        )

    first, ended, conflict, second = run(group())
    assert (first, second) == (0, 1) and store.commits == commits + 1
    assert isinstance(ended, RolloutEnded) and isinstance(conflict, RolloutConflict)
    assert store.get_rollout("fresh") is None and store.get_turns("over") == []
    # Alone in its group (no savepoint), a refused batch leaves nothing either.
    with pytest.raises(RolloutConflict):
        run(store.create_rollouts([new("fresh"), new("ok", task="other")]))
    assert store.get_rollout("fresh") is None
    assert run(store.add_turn("ok", NewTurn([5], [6], None, 0, "stop"))) == 2
    assert [t.prompt_ids for t in store.get_turns("ok")] == [[1], [3], [5]]


def test_key_lookups_follow_the_stores_writes(store):
    """head_by_key_hash is answered from memory after the first read; every write through the
    store that changes what it returns is seen by the next lookup."""
    run(store.create_rollouts([new("k")]))
    head = store.head_by_key_hash(b"hash-k")
    assert (head.rollout_id, head.state) == ("k", RolloutState.queued)
    assert store.head_by_key_hash(b"hash-k") is head  # from memory
    run(store.add_turn("k", NewTurn([1], [2], None, 0, "stop")))
    assert store.head_by_key_hash(b"hash-k").state == RolloutState.running
    run(store.set_state("k", "succeeded"))
    assert store.head_by_key_hash(b"hash-k").state == RolloutState.succeeded
    with pytest.raises(RolloutEnded):
        run(store.add_turn("k", NewTurn([1], [2], None, 0, "stop")))
    assert store.head_by_key_hash(b"hash-k").state == RolloutState.succeeded
    run(store.rekey_rollout("k", b"salt-2", b"hash-k2"))
    assert store.head_by_key_hash(b"hash-k") is None
    assert store.head_by_key_hash(b"hash-k2").rollout_id == "k"
    run(store.delete_rollout("k"))
    assert store.head_by_key_hash(b"hash-k2") is None
    # What this store reads matches the file, as another connection sees it.
    run(store.create_rollouts([new("k2")]))
    run(store.start("k2"))
    with sqlite3.connect(store.path) as other:
        (state,) = other.execute("SELECT state FROM rollouts WHERE rollout_id = 'k2'").fetchone()
    assert store.head_by_key_hash(b"hash-k2").state.value == state == "running"


def test_load_rollouts_gives_validated_finished_rollouts(store):
    run(store.create_rollouts([new("done", group_id="G"), new("live", group_id="G")]))
    run(store.add_turn("done", NewTurn([1, 2], [3, 2], [-0.5, -0.25], 3, "stop")))
    run(store.add_turn("live", NewTurn([1, 2], [3], [-0.5], 3, "stop")))
    run(store.add_event("done", "reward", None, reward=1.0))
    run(store.set_state("done", "succeeded"))
    (r,) = store.load_rollouts(group_id="G")
    assert isinstance(r, Rollout)
    assert (r.rollout_id, r.group_id, r.reward, r.state) == ("done", "G", 1.0, "succeeded")
    assert [(list(t.prompt_ids), list(t.response_ids), t.model_version) for t in r.turns] == [
        ([1, 2], [3, 2], 3)
    ]
    # The stored bytes, as arrays: int32 ids, float32 logprobs (-0.5 and -0.25 are exact there).
    (t,) = r.turns
    assert (t.prompt_ids.typecode, t.response_ids.typecode, t.response_logprobs.typecode) == ("i", "i", "f")
    assert list(t.response_logprobs) == [-0.5, -0.25]
    with pytest.raises(UnknownRollout):
        store.load_rollouts(rollout_ids=["done", "ghost"])


@given(st.lists(st.integers(0, 2**31 - 1), max_size=200))
def test_id_blobs_round_trip(ids):
    blob = ids_to_blob(ids)
    assert len(blob) == 4 * len(ids) and blob_to_ids(blob) == ids


@given(st.lists(st.floats(-1e4, 0.0, width=32), max_size=100))
def test_float32_blobs_round_trip_exactly_for_float32_values(xs):
    assert blob_to_floats(floats_to_blob(xs)) == xs


def test_schema_is_versioned_and_survives_reopen(tmp_path):
    path = tmp_path / "v.db"
    with SQLiteStore(path) as s:
        run(s.create_rollouts([new("keep")]))
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        SQLiteStore(path)
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.close()
    with SQLiteStore(path) as s:
        assert s.get_rollout("keep") is not None


def test_a_version_2_file_is_migrated_and_its_turns_read_as_before(tmp_path):
    """A file written before prompts could continue an earlier turn (schema 2) opens, reads its
    turns whole, and takes continued turns after them."""
    from tracetrain.store import MIGRATIONS

    path = tmp_path / "v2.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for v, script in enumerate(MIGRATIONS[:2]):
        conn.executescript(f"BEGIN; {script}; PRAGMA user_version = {v + 1}; COMMIT;")
    conn.execute(
        "INSERT INTO rollouts (rollout_id, group_id, task, state, key_salt, key_hash, created_at,"
        " updated_at, n_turns) VALUES ('old', 'g', 'null', 'running', x'00', x'01', 0, 0, 1)"
    )
    conn.execute(
        "INSERT INTO turns (rollout_id, idx, prompt_ids, response_ids, created_at) VALUES"
        " ('old', 0, ?, ?, 0)", (ids_to_blob([5, 6, 7]), ids_to_blob([8, 9]))
    )
    conn.close()
    with SQLiteStore(path) as s:
        run(s.add_turn("old", NewTurn([5, 6, 7, 8, 9, 10], [11], None, 0, "stop", context="exact",
                                      reused_tokens=5, prompt_from=0)))
        assert [t.prompt_ids for t in s.get_turns("old")] == [[5, 6, 7], [5, 6, 7, 8, 9, 10]]
        # turns from before roles (schema 4) are the default role's, with no turn reward
        assert [(t.role, t.reward) for t in s.get_turns("old")] == [("policy", None)] * 2
        # and from before the messages were kept (schema 5): none
        assert [t.messages for t in s.get_turns("old")] == [None, None]
        # nor tool stats (schema 6)
        assert [t.tools for t in s.get_turns("old")] == [None, None]
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6
    conn.close()


def test_tool_stats_round_trip_to_the_trainers_turns_and_an_older_file_reads_none(tmp_path):
    """A turn's tool stats are three columns (NULL: no tools offered), read back on TurnRecord
    and on the Turns the trainer loads; a read-only store of a schema-5 file reads None."""
    path = tmp_path / "tools.db"
    with SQLiteStore(path) as s:
        run(s.create_rollouts([new("t", group_id="G")]))
        run(s.add_turn("t", NewTurn([1], [2], None, 0, "stop", tools=ToolStats(3, 1, 2))))
        run(s.add_turn("t", NewTurn([1, 2, 5], [6], None, 0, "stop")))
        run(s.set_state("t", "succeeded"))
        assert [t.tools for t in s.get_turns("t")] == [ToolStats(3, 1, 2), None]
        (r,) = s.load_rollouts(group_id="G")
        assert [t.tools for t in r.turns] == [ToolStats(3, 1, 2), None]
    with sqlite3.connect(path) as conn:
        row = conn.execute("SELECT tool_calls, tool_parse_failures, tool_unknown FROM turns"
                           " ORDER BY idx").fetchall()
    assert row == [(3, 1, 2), (None, None, None)]

    old = tmp_path / "v5.db"
    conn = sqlite3.connect(old, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for v, script in enumerate(MIGRATIONS[:5]):
        conn.executescript(f"BEGIN; {script}; PRAGMA user_version = {v + 1}; COMMIT;")
    conn.execute("INSERT INTO rollouts (rollout_id, group_id, task, state, key_salt, key_hash,"
                 " created_at, updated_at, n_turns) VALUES ('o', 'g', 'null', 'running', x'00',"
                 " x'01', 0, 0, 1)")
    conn.execute("INSERT INTO turns (rollout_id, idx, prompt_ids, response_ids, created_at, messages)"
                 " VALUES ('o', 0, ?, ?, 0, '[]')", (ids_to_blob([5]), ids_to_blob([6])))
    conn.close()
    with SQLiteStore(old, read_only=True) as s:
        (t,) = s.get_turns("o")
        assert (t.messages, t.tools) == ("[]", None)
    with pytest.raises(TraceError, match="tools.calls is -1"):
        Rollout("x", "g", [Turn([1], [2], tools=ToolStats(-1, 0, 0))])


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="synchronous"):
        SQLiteStore(tmp_path / "x.db", synchronous="OFF")
    with pytest.raises(ValueError, match="file path"):
        SQLiteStore(":memory:")


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from tracetrain.store import SQLiteStore, NewRollout, NewTurn
    store = SQLiteStore(sys.argv[1])
    async def main():
        await store.create_rollouts([NewRollout("k", "g", None, None, b"s", b"h")])
        print("created", flush=True)
        for i in range(100000):
            idx = await store.add_turn("k", NewTurn([i], [i + 1], [-1.0], 0, "stop"))
            print(idx, flush=True)  # acknowledged: committed before this line
    asyncio.run(main())
    """
)


def test_acknowledged_turns_survive_kill_9(tmp_path):
    path = tmp_path / "crash.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    acked = -1
    for line in proc.stdout:
        if line.strip().isdigit():
            acked = int(line)
            if acked >= 300:
                break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with SQLiteStore(path) as s:
        turns = s.get_turns("k")
        assert len(turns) >= acked + 1
        assert [t.index for t in turns] == list(range(len(turns)))
        assert all(t.prompt_ids == [t.index] for t in turns)


@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL"])
def test_group_commit_in_both_durability_modes(tmp_path, synchronous):
    with SQLiteStore(tmp_path / f"{synchronous}.db", synchronous=synchronous) as store:
        run(store.create_rollouts([new(f"d{i}") for i in range(8)]))

        async def main():
            async def agent(i):
                return [
                    await store.add_turn(f"d{i}", NewTurn([i, k], [1], None, 0, "stop"))
                    for k in range(10)
                ]

            return await asyncio.gather(*(agent(i) for i in range(8)))

        assert run(main()) == [list(range(10))] * 8
        assert store.commits < 8 * 10 + 1  # writes shared commits
        assert [t.prompt_ids for t in store.get_turns("d3")] == [[3, k] for k in range(10)]


def test_wal_is_checkpointed_in_the_background(tmp_path):
    path = tmp_path / "wal.db"
    with SQLiteStore(path) as store:
        run(store.create_rollouts([new("w")]))
        prompt = list(range(1000))  # 4 KB per turn

        async def main():
            for _ in range(2000):  # one commit each, ~6 WAL pages per commit: ~50 MB of WAL frames
                await store.add_turn("w", NewTurn(prompt, [1], None, 0, "stop"))

        run(main())
        wal = path.with_name(path.name + "-wal").stat().st_size
        assert store.get_rollout("w").n_turns == 2000
        assert wal < 32_000_000, wal  # restarted after checkpoints (~8-10 MB measured), not all ~50 MB


# --- roles and turn rewards --------------------------------------------------------------------


def test_roles_and_turn_rewards_round_trip_and_survive_reopen(tmp_path):
    path = tmp_path / "roles.db"
    with SQLiteStore(path) as s:
        run(s.create_rollouts([new("a", group_id="G")]))
        run(s.add_turn("a", NewTurn([1, 2], [3], [-0.5], 0, "stop", role="solver")))
        run(s.add_turn("a", NewTurn([1, 2, 3, 4], [5], [-0.25], 0, "stop", role="checker")))
        run(s.add_turn("a", NewTurn([1, 2, 3, 4, 5, 6], [7], [-0.125], 0, "stop")))  # no role
        first = run(s.add_turn_reward("a", 0.5, turn=0, name="parsed"))
        run(s.add_turn_reward("a", -0.25, turn=0))
        latest = run(s.add_turn_reward("a", 2.0, name="tests_passed"))  # the latest turn: 2
        assert (first.turn, first.name, latest.turn) == (0, "parsed", 2)
        run(s.add_event("a", "reward", None, reward=1.0))
        run(s.set_state("a", "succeeded"))
    with SQLiteStore(path) as s:  # durable: read back from the file
        turns = s.get_turns("a")
        assert [t.role for t in turns] == ["solver", "checker", "policy"]
        assert [t.reward for t in turns] == [0.25, None, 2.0]
        assert [(r.name, r.reward) for r in turns[0].rewards] == [("parsed", 0.5), (None, -0.25)]
        assert [(r.turn, r.reward) for r in s.get_turn_rewards("a")] == [(0, 0.5), (0, -0.25), (2, 2.0)]
        (r,) = s.load_rollouts(rollout_ids=["a"])
        assert [(t.role, t.reward) for t in r.turns] == [("solver", 0.25), ("checker", None),
                                                         ("policy", 2.0)]
        assert r.reward == 1.0  # the final reward stays the rollout's


def test_turn_rewards_for_a_missing_turn_or_an_ended_rollout_are_refused(store):
    from tracetrain.store import UnknownTurn

    run(store.create_rollouts([new("a")]))
    with pytest.raises(UnknownTurn, match="no turn yet"):
        run(store.add_turn_reward("a", 1.0))
    run(store.add_turn("a", NewTurn([1], [2], None, 0, "stop")))
    for bad in (1, -1, 7):
        with pytest.raises(UnknownTurn, match=f"no turn {bad}: its turns are 0..0"):
            run(store.add_turn_reward("a", 1.0, turn=bad))
    with pytest.raises(UnknownRollout):
        run(store.add_turn_reward("ghost", 1.0))
    run(store.set_state("a", "succeeded"))
    with pytest.raises(RolloutEnded, match="no more turn rewards"):
        run(store.add_turn_reward("a", 1.0, turn=0))
    assert store.get_turn_rewards("a") == []  # nothing recorded from a refused write
    run(store.delete_rollout("a"))
    run(store.create_rollouts([new("a")]))
    run(store.add_turn("a", NewTurn([1], [2], None, 0, "stop")))
    assert store.get_turns("a")[0].reward is None  # deleted with its rollout


def test_a_reader_beside_a_store_being_created_sees_it_not_ready_or_whole(tmp_path):
    """`tracetrain view` polls a run whose trainer is creating traces.db: a read-only open then
    fails only as StoreNotReady (the viewer's 'not written yet'), never as a store of an old
    schema. The schema of a new store is written in one transaction, and the reader takes the
    version and the tables from one snapshot."""
    import threading

    from tracetrain.store.records import StoreNotReady
    from tracetrain.store.schema import check_readable

    paths = [str(tmp_path / f"s{i}.db") for i in range(20)]
    done, seen, wrong = threading.Event(), [], []

    def create():
        try:
            for p in paths:
                SQLiteStore(p).close()
        finally:  # the reader's loop ends even when a store fails (then the counts below do)
            done.set()

    def read():  # until a pass that began after the last store was made
        while True:
            last = done.is_set()
            for p in paths:
                if not os.path.exists(p):
                    continue
                try:
                    seen.append(check_readable(p))
                except StoreNotReady:
                    seen.append("not ready")
                except StoreError as e:
                    wrong.append(str(e))
            if last:
                return

    threads = [threading.Thread(target=f, daemon=True) for f in (create, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not wrong, wrong[:3]
    assert seen.count(SCHEMA_VERSION) >= len(paths)
    assert all(check_readable(p) == SCHEMA_VERSION for p in paths)
