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

from tracetrain.aggregate import aggregate
from tracetrain.config import ConfigError, TrainConfig
from tracetrain.credit import batch_credit
from tracetrain.loss import rollout_mass
from tracetrain.minibatch import plan_step
from tracetrain.roles import trains
from tracetrain.store import SQLiteStore


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
    from tracetrain.models import load_tokenizer

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
    ac = cfg.aggregate if cfg is not None else None
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
    batch, agg, breaks = aggregate(
        rollouts,
        level=ac.level if ac else "trajectory",
        max_prompt_length=ac.max_prompt_length if ac else 1 << 20,
        max_response_length=ac.max_response_length if ac else 1 << 20,
        pad_token_id=(tok.pad_token_id or 0) if tok is not None else 0,
        tokenizer=tok,
        overlong=ac.overlong if ac else "drop_rollout",
        return_breaks=True,
        train_roles=train_roles,
    )
    shown: dict = {"rollout_id": rollout_id, "rows": 0, "breaks": [], "advantage": None, "loss_mass": None}
    mine_breaks = [b for b in breaks if b.rollout_id == rollout_id]
    for b in mine_breaks:
        out(f"  break at turn {b.turn_index}: {b.kind}, position {b.position}, "
            f"{b.recomputed_tokens} tokens recomputed\n    {b.snippet}")
        shown["breaks"].append(b.kind)
    if rollout_id not in batch.rollouts:
        out("  not in the training batch (dropped or excluded; see the metrics)")
        return shown
    est = cfg.advantage if cfg is not None else None
    kept, adv, _ = batch_credit(
        batch, rollouts, estimator=est.estimator if est else "grpo", train_roles=train_roles,
        gamma=est.gamma if est else 1.0, step_weight=est.step_weight if est else 1.0,
        failed_rollouts=est.failed_rollouts if est else "exclude")
    if rollout_id not in kept.rollouts:
        out("  excluded from training (failed or timed out)")
        return shown
    k = kept.rollouts.index(rollout_id)
    mode = cfg.loss.mode if cfg is not None else "rollout-mean"
    oc = cfg.optim if cfg is not None else None
    plan = plan_step(  # as update.ppo_update plans the step (every epoch plans the same)
        kept.response_mask, kept.rollout_index,
        n_mini_batches=min(oc.mini_batches, kept.n_rollouts) if oc else 1,
        micro_batch_tokens=oc.micro_batch_tokens if oc else None, mode=mode,
        norm_length=cfg.loss.norm_length if cfg is not None else None,
        row_tokens=kept.attention_mask.sum(1))
    rows = (kept.rollout_index == k).nonzero().squeeze(1)
    j, mb = next((j, mb) for j, mb in enumerate(plan) if bool((mb.rows == rows[0]).any()))
    own = kept.rollout_index[mb.rows] == k  # this rollout's rows within its mini-batch
    mass = float(rollout_mass(kept.response_mask[mb.rows[own]], kept.rollout_index[mb.rows[own]],
                              mb.row_scales[own])[0])
    P = kept.prompt_length
    for i in rows.tolist():
        ids = kept.input_ids[i][kept.attention_mask[i].bool()].tolist()
        n_prompt = int(kept.attention_mask[i, :P].sum())
        resp = kept.input_ids[i, P:]
        trained = resp[kept.response_mask[i]].tolist()
        out(f"  row {i} (from turn {int(kept.turn_index[i])}): {len(ids)} tokens, prompt {n_prompt}, "
            f"trained {len(trained)}")
        out(f"    trained text: {_text(tok, trained)!r}")
    name = est.estimator if est else "grpo"
    if adv.dim() == 2:  # per turn: each turn's tokens carry its own
        advantage = {t: float(adv[i, start]) for i in rows.tolist()
                     for t, start, _ in kept.turn_spans[i]}
        per_turn = ", ".join(f"turn {t} {a:+.4f}" for t, a in sorted(advantage.items()))
        out(f"  advantage per turn ({name} within its group): {per_turn}")
    else:
        advantage = float(adv[k])
        out(f"  advantage {advantage:+.4f} ({name} within its group)")
    out(f"  loss mass {mass:.4f} of 1 in mini-batch {j + 1} of {len(plan)}: {mb.n_rollouts} of its "
        f"step's {kept.n_rollouts} rollouts (mode {mode})")
    shown.update(rows=len(rows), advantage=advantage, loss_mass=mass, mini_batch=j,
                 n_mini_batches=len(plan), n_rollouts_in_mini_batch=mb.n_rollouts,
                 n_rollouts_in_step=kept.n_rollouts, metrics=json.loads(json.dumps(agg, default=str)))
    return shown
