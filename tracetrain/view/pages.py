"""What each page shows, as plain data for its template (no I/O: the routes read, these shape).

    step_table(records, step, query)           the step page's rows, filtered and sorted
    rollout_view(record, turns, step, tok, known)   one rollout down to the token
    tools_text(stats)                          a turn's (or a rollout's) tool stats in words

A rollout whose engine (the rollouts table's) is EXPERT is an expert demonstration (played by a
scripted policy or another model before RL, never the policy's reward): both pages mark it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from tracetrain.rows.drift import first_difference
from tracetrain.store.records import RolloutRecord, TurnRecord
from tracetrain.types import ToolStats
from tracetrain.view.explain import TRAINED, Explained, StepExplained
from tracetrain.view.tokens import token_pieces

TAUGHT = ("teacher_logprob", "distill", "reward_advantage")  # TokenRow's lists with a teacher
SORTS = ("group", "reward", "advantage", "rows", "turns", "breaks", "state")
EXPERT = "expert"  # the engine of an expert demonstration's rollout


def tools_text(stats: list[ToolStats]) -> str:
    """What answers did with the tools offered, summed over `stats`: "n calls" then the parse
    failures and calls of unknown tools when there are any; "" when no tools were offered."""
    if not stats:
        return ""
    calls, failed, unknown = (sum(getattr(s, k) for s in stats)
                              for k in ("calls", "parse_failures", "unknown"))
    parts = [f"{calls} call{'s' if calls != 1 else ''}"]
    if failed:
        parts.append(f"{failed} unparsed")
    if unknown:
        parts.append(f"{unknown} unknown tool{'s' if unknown != 1 else ''}")
    return ", ".join(parts)


@dataclass
class StepQuery:
    """The step page's filters: state (a RolloutState value or "failed-or-timed-out"), break
    cause, reward bounds, sort key (SORTS) and direction."""

    state: str | None = None
    cause: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    sort: str = "group"
    descending: bool = False


@dataclass
class StepRow:
    rollout_id: str
    group_id: str
    state: str
    reward: float | None
    advantage: str
    advantage_value: float | None
    status: str
    rows: int
    trained_tokens: int
    mass: float | None
    breaks: list[str]
    roles: list[str]
    turns: int
    turn_rewards: str
    tools: str = ""  # tools_text of its turns
    expert: bool = False  # an expert demonstration (EXPERT)


def _advantage(e: Explained | None) -> tuple[str, float | None]:
    if e is None or e.advantage is None:
        return "", None
    if isinstance(e.advantage, dict):
        values = list(e.advantage.values())
        return ", ".join(f"{t}:{a:+.3f}" for t, a in sorted(e.advantage.items())), (
            sum(values) / len(values) if values else None)
    return f"{e.advantage:+.4f}", e.advantage


def step_table(records: list[RolloutRecord], turns: dict[str, list[TurnRecord]],
               step: StepExplained | None, q: StepQuery) -> list[StepRow]:
    out = []
    for r in records:
        e = step.summary.get(r.rollout_id) if step is not None else None
        ts = turns.get(r.rollout_id, [])
        given = [x.reward for t in ts for x in t.rewards]
        adv_text, adv = _advantage(e)
        out.append(StepRow(
            r.rollout_id, r.group_id, r.state.value, r.reward, adv_text, adv,
            e.status if e is not None else ("running" if not r.state.terminal else ""),
            e.n_rows if e else 0, e.trained_tokens if e else 0, e.mass if e else None,
            [b.kind for b in e.breaks] if e else [], sorted({t.role for t in ts}), r.n_turns,
            f"{len(given)} ({sum(given):+g})" if given else "",
            tools_text([t.tools for t in ts if t.tools is not None]), r.engine == EXPERT))
    if q.state == "failed-or-timed-out":
        out = [x for x in out if x.state in ("failed", "timed_out")]
    elif q.state:
        out = [x for x in out if x.state == q.state]
    if q.cause:
        out = [x for x in out if q.cause in x.breaks]
    if q.min_reward is not None:
        out = [x for x in out if x.reward is not None and x.reward >= q.min_reward]
    if q.max_reward is not None:
        out = [x for x in out if x.reward is not None and x.reward <= q.max_reward]
    key = {
        "group": lambda x: (x.group_id, x.rollout_id),
        "reward": lambda x: (x.reward is None, x.reward if x.reward is not None else 0.0),
        "advantage": lambda x: (x.advantage_value is None, x.advantage_value or 0.0),
        "rows": lambda x: x.rows, "turns": lambda x: x.turns, "breaks": lambda x: len(x.breaks),
        "state": lambda x: x.state,
    }[q.sort]
    return sorted(out, key=key, reverse=q.descending)


@dataclass
class TokenView:
    text: str
    whole: bool  # False: not whole text alone (tokens.py); shown as the tokenizer's name for it
    kind: str  # prompt | observation | trained | response (a turn's reply that was not trained)
    id: int
    weight: float = 0.0
    advantage: float | None = None
    logprob: float | None = None
    turn: int | None = None
    pos: int | None = None  # prompt tokens: the position in the row's first turn's prompt
    brk: str | None = None  # a drift break at this token: its kind and cost
    teacher_logprob: float | None = None  # with a teacher (config `distill`): its logprob
    distill: float | None = None  # and the token's distillation advantage
    reward_advantage: float | None = None  # beside the reward-based one


@dataclass
class RowView:
    title: str
    tokens: list[TokenView]
    n_trained: int = 0
    weight_sum: float = 0.0
    break_note: str | None = None


@dataclass
class TurnView:
    index: int
    role: str
    model_version: int | None
    prompt_tokens: int
    response_tokens: int
    built: str
    finish_reason: str | None
    rewards: str
    messages: str | None  # pretty JSON of what the agent sent (text: the template escapes it)
    policy: str = ""  # several policies: the one that made it ("base": a role of none)
    tools: str = ""  # tools_text of its answer ("": no tools offered)


@dataclass
class RolloutView:
    record: RolloutRecord
    status: str
    advantage: str
    mass: float | None
    mini_batch: str
    turns: list[TurnView]
    rows: list[RowView]
    breaks: list[str] = field(default_factory=list)
    versions: str = ""

    @property
    def expert(self) -> bool:
        """An expert demonstration (EXPERT), not the policy's."""
        return self.record.engine == EXPERT


def _messages(raw: str | None) -> str | None:
    if raw is None:
        return None
    try:
        return json.dumps(json.loads(raw), indent=1, ensure_ascii=False)
    except json.JSONDecodeError:
        return raw


def _built(t: TurnRecord) -> str:
    if t.context == "exact":
        return f"exact: {t.reused_tokens} ids of an earlier turn + the new messages"
    if t.context == "rendered":
        return f"rendered in full ({t.context_reason})"
    return "a raw prompt"


def rollout_view(rec: RolloutRecord, turns: list[TurnRecord], step: StepExplained | None,
                 tokenizer, known: dict, role_policies: dict[str, str] | None = None) -> RolloutView:
    """`role_policies` (several policies): role -> policy, each turn's shown ("base" for none)."""
    e = step.summary.get(rec.rollout_id) if step is not None else None
    turn_views = [
        TurnView(t.index, t.role, t.model_version, len(t.prompt_ids), len(t.response_ids), _built(t),
                 t.finish_reason,
                 ", ".join(f"{x.name + ' ' if x.name else ''}{x.reward:+g}" for x in t.rewards),
                 _messages(t.messages),
                 "" if role_policies is None else role_policies.get(t.role, "base"),
                 tools_text([t.tools] if t.tools is not None else []))
        for t in turns
    ]
    versions = sorted({t.model_version for t in turns if t.model_version is not None})
    adv, _ = _advantage(e)
    view = RolloutView(
        rec, e.status if e is not None else ("running" if not rec.state.terminal else "not in a step"),
        adv, e.mass if e is not None else None,
        f"{e.mini_batch + 1} of {step.n_mini_batches}" if e is not None and e.mini_batch is not None else "",
        turn_views, [], versions=", ".join(map(str, versions)))
    breaks = e.breaks if e is not None else []
    view.breaks = [f"turn {b.turn_index}: {b.kind} at prompt position {b.position}, "
                   f"{b.recomputed_tokens} tokens recomputed" for b in breaks]
    if e is not None and e.status == TRAINED:
        for row in step.rows(rec.rollout_id):
            pieces = token_pieces(tokenizer, row.ids, known)
            toks = []
            for j, (text, whole) in enumerate(pieces):
                w = row.weight[j]
                taught = {k: getattr(row, k)[j] for k in TAUGHT if getattr(row, k)}
                toks.append(TokenView(text, whole, row.kind[j], row.ids[j], w, row.advantage[j],
                                      row.logprob[j], row.turn[j],
                                      row.prompt_offset + j if j < row.n_prompt else None,
                                      **taught))
            rv = RowView(f"row {row.index} (from turn {row.first_turn}): {len(row.ids)} tokens, "
                         f"prompt {row.n_prompt}", toks,
                         n_trained=sum(k == "trained" for k in row.kind),
                         weight_sum=math.fsum(row.weight))
            for b in breaks:
                if b.turn_index != row.first_turn:
                    continue
                j = max(0, min(b.position - row.prompt_offset, row.n_prompt - 1))
                toks[j].brk = f"{b.kind}: {b.recomputed_tokens} tokens recomputed"
                rv.break_note = (f"this row starts at a drift break: {b.kind} at position "
                                 f"{b.position} of turn {b.turn_index}'s prompt")
            view.rows.append(rv)
        return view
    # Not trained (failed, timed out, dropped, still running): each turn as it was recorded, its
    # prompt from where it stops repeating the turn before (prompt + response).
    before: list[int] = []
    for t in turns:
        same = first_difference(before, t.prompt_ids)
        before = list(t.prompt_ids) + list(t.response_ids)
        n, ids = len(t.prompt_ids) - same, before[same:]
        lps = t.response_logprobs or [None] * len(t.response_ids)
        toks = [TokenView(text, whole, "prompt" if j < n else "response", ids[j],
                          logprob=lps[j - n] if j >= n else None, turn=t.index if j >= n else None,
                          pos=same + j if j < n else None)
                for j, (text, whole) in enumerate(token_pieces(tokenizer, ids, known))]
        skipped = f" ({same} prompt tokens as in the turn before, not repeated)" if same else ""
        view.rows.append(RowView(f"turn {t.index} [{t.role}]: prompt {len(t.prompt_ids)}, response "
                                 f"{len(t.response_ids)}{skipped}", toks))
    return view
