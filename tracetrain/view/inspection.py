"""`tracetrain inspect`: one rollout from a run, down the path of the data.

Shows its turns (decoded, the role that made each and whether it trains, the rewards given to it,
and how each prompt was built: exact or rendered), the rows it became (trained tokens marked), the
drift breaks that cut it (with decoded snippets), its advantage within its group (per turn with a
turn-level estimator), and its loss weight: the share of the
mass of the optimizer update it was trained in (its step's rows planned into mini-batches as the
trainer plans them, from the run's own config: optim.mini_batches, micro_batch_tokens, loss.mode).
"""

from __future__ import annotations

import json
from pathlib import Path

from tracetrain.config import ConfigError, TrainConfig
from tracetrain.rows.roles import trains
from tracetrain.store import SQLiteStore
from tracetrain.view.explain import DROPPED, EXCLUDED, explain_step


def _open(run: Path) -> tuple[SQLiteStore, TrainConfig | None]:
    if run.is_dir():
        db, cfg_path = run / "traces.db", run / "config.json"
    else:
        db, cfg_path = run, run.parent / "config.json"
    if not db.is_file():
        raise ConfigError(f"no trace store at {str(db)!r}")
    cfg = TrainConfig.model_validate_json(cfg_path.read_text()) if cfg_path.is_file() else None
    return SQLiteStore(db), cfg


def _tokenizer(cfg: TrainConfig | None):
    from tracetrain.models.load import load_tokenizer

    return None if cfg is None else load_tokenizer(cfg.model)


def _text(tok, ids) -> str:
    if tok is None:
        return " ".join(map(str, ids))
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _step_prefix(group_id: str) -> str:
    """Group ids are `<run>-s<step>-t<task>`: the step's rollouts share what precedes `-t`."""
    return group_id.rsplit("-t", 1)[0]


def inspect_rollout(run: str | Path, rollout_id: str | None = None, *, out=print) -> dict:
    """Print one rollout (default: the last finished training rollout) and return the figures shown."""
    store, cfg = _open(Path(run))
    try:
        done = [r for r in store.list_rollouts(limit=1_000_000) if r.state.terminal]
        if rollout_id is None:
            if not done:
                raise ConfigError(f"{run}: no finished rollout to inspect")
            trained = [r for r in done if "-eval" not in r.group_id]  # eval passes do not train
            rollout_id = (trained or done)[-1].rollout_id
        rec = store.get_rollout(rollout_id)
        if rec is None:
            raise ConfigError(f"{run}: no rollout {rollout_id!r}")
        prefix = _step_prefix(rec.group_id)
        step_ids = [r.rollout_id for r in done if _step_prefix(r.group_id) == prefix]
        rollouts = store.load_rollouts(rollout_ids=step_ids)
        records = store.get_turns(rollout_id)
        how = [(t.context, t.context_reason, t.reused_tokens) for t in records]
    finally:
        store.close()
    tok = _tokenizer(cfg)
    train_roles = cfg.roles.train if cfg is not None else None
    mine = next(r for r in rollouts if r.rollout_id == rollout_id)
    out(f"rollout {rollout_id}  group {mine.group_id}  state {mine.state.value}  reward {mine.reward}")
    for k, t in enumerate(mine.turns):
        context, reason, reused = how[k]
        built = {"exact": f"exact: {reused} ids of the turn before + the new messages",
                 "rendered": f"rendered in full ({reason})"}.get(context, "a raw prompt")
        role = t.role if trains(t.role, train_roles) else f"{t.role}, not trained"
        out(f"  turn {k} [{role}] (model_version {t.model_version}): prompt {len(t.prompt_ids)} "
            f"tokens, response {len(t.response_ids)} tokens; prompt {built}")
        out(f"    response: {_text(tok, t.response_ids)!r}")
        if records[k].rewards:
            given = ", ".join(f"{x.name + ' ' if x.name else ''}{x.reward:+g}" for x in records[k].rewards)
            out(f"    turn rewards: {given}")
    step = explain_step(rollouts, cfg if cfg is not None else TrainConfig(), tok)
    e = step.summary[rollout_id]
    shown: dict = {"rollout_id": rollout_id, "rows": 0, "breaks": [], "advantage": None, "loss_mass": None}
    for b in e.breaks:
        out(f"  break at turn {b.turn_index}: {b.kind}, position {b.position}, "
            f"{b.recomputed_tokens} tokens recomputed\n    {b.snippet}")
        shown["breaks"].append(b.kind)
        shown.setdefault("break_positions", []).append((b.turn_index, b.position))
    if e.status == DROPPED:
        out("  not in the training batch (dropped or excluded; see the metrics)")
        return shown
    if e.status == EXCLUDED:
        out("  excluded from training (failed or timed out)")
        return shown
    for row in step.rows(rollout_id):
        trained = [t for t, kind in zip(row.ids, row.kind, strict=True) if kind == "trained"]
        out(f"  row {row.index} (from turn {row.first_turn}): {len(row.ids)} tokens, prompt "
            f"{row.n_prompt}, trained {len(trained)}")
        out(f"    trained text: {_text(tok, trained)!r}")
    if isinstance(e.advantage, dict):
        per_turn = ", ".join(f"turn {t} {a:+.4f}" for t, a in sorted(e.advantage.items()))
        out(f"  advantage per turn ({step.estimator} within its group): {per_turn}")
    else:
        out(f"  advantage {e.advantage:+.4f} ({step.estimator} within its group)")
    j = e.mini_batch
    out(f"  loss mass {e.mass:.4f} of 1 in mini-batch {j + 1} of {step.n_mini_batches}: "
        f"{step.mini_batch_rollouts[j]} of its step's {step.n_rollouts} rollouts (mode {step.mode})")
    shown.update(rows=e.n_rows, advantage=e.advantage, loss_mass=e.mass, mini_batch=j,
                 n_mini_batches=step.n_mini_batches, n_rollouts_in_mini_batch=step.mini_batch_rollouts[j],
                 n_rollouts_in_step=step.n_rollouts,
                 metrics=json.loads(json.dumps(step.metrics, default=str)))
    return shown
