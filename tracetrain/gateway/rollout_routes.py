"""Rollout routes: create (idempotent on ids), get with turns, list by state with paging, patch
state (legal transitions only, 409 otherwise) and reward override, one or many in a call;
delete; rewards and events.

Admin key: everything. A rollout's own key: only POST its rewards and events, while it is open.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from tracetrain.gateway.errors import ApiError
from tracetrain.gateway.keys import (
    Principal,
    RolloutIdPath,
    derive_rollout_key,
    hash_key,
    new_salt,
    principal,
    require_admin,
    rollout_access,
)
from tracetrain.gateway.schemas.base import State
from tracetrain.gateway.schemas.rollouts import (
    CreatedRolloutOut,
    CreateRolloutsIn,
    CreateRolloutsOut,
    EventIn,
    EventOut,
    EventsOut,
    PatchResultOut,
    PatchRolloutIn,
    PatchRolloutsIn,
    PatchRolloutsOut,
    RewardIn,
    RolloutDetailOut,
    RolloutOut,
    RolloutPageOut,
    TurnOut,
    TurnRewardIn,
    TurnRewardOut,
)
from tracetrain.store import (
    EventRecord,
    IllegalTransition,
    NewRollout,
    RolloutConflict,
    RolloutEnded,
    RolloutHead,
    RolloutRecord,
    UnknownRollout,
)

router = APIRouter(tags=["rollouts"])
admin = [Depends(require_admin)]


def rollout_out(r: RolloutRecord) -> dict:
    return {
        "rollout_id": r.rollout_id,
        "group_id": r.group_id,
        "task": r.task,
        "engine": r.engine,
        "state": r.state.value,
        "error": r.error,
        "reward": r.reward,
        "n_turns": r.n_turns,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
    }


def event_out(e: EventRecord) -> EventOut:
    return EventOut(
        event_id=e.event_id,
        kind=e.kind,
        payload=e.payload,
        reward=e.reward,
        created_at=e.created_at,
    )


def _existing(request: Request, rollout_id: str) -> RolloutRecord:
    r = request.app.state.gateway.store.get_rollout(rollout_id)
    if r is None:
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")
    return r


@router.post("/rollouts", dependencies=admin, response_model=CreateRolloutsOut)
async def create_rollouts(body: CreateRolloutsIn, request: Request):
    """Create rollouts; an id that exists with the same group, task and engine is returned as is
    (created=false) with its key, so a retried batch is safe."""
    gw = request.app.state.gateway
    specs, keys, seen = [], {}, set()
    for k, r in enumerate(body.rollouts):
        rid = r.rollout_id or uuid.uuid4().hex
        if rid in seen:
            raise ApiError(
                400, f"rollouts[{k}].rollout_id {rid!r} appears twice in the batch", "rollout_id"
            )
        seen.add(rid)
        if r.engine is not None and r.engine not in gw.slots:
            known = ", ".join(sorted(gw.slots))
            raise ApiError(
                400, f"rollouts[{k}].engine {r.engine!r} is unknown; engines: {known}", "engine"
            )
        salt = new_salt()
        keys[rid] = derive_rollout_key(gw.admin_key, rid, salt)
        specs.append(
            NewRollout(rid, r.group_id or rid, r.task, r.engine, salt, hash_key(keys[rid]))
        )
    out = []
    for rec, created in await gw.store.create_rollouts(specs):
        rid = rec.rollout_id
        if not created:
            keys[rid] = derive_rollout_key(gw.admin_key, rid, rec.key_salt)
            if hash_key(keys[rid]) != rec.key_hash:  # made under another admin key: issue a new one
                salt = new_salt()
                keys[rid] = derive_rollout_key(gw.admin_key, rid, salt)
                await gw.store.rekey_rollout(rid, salt, hash_key(keys[rid]))
        out.append(
            CreatedRolloutOut(
                **rollout_out(rec),
                created=created,
                base_url=gw.base_url(request, rid),
                api_key=keys[rid],
            )
        )
    return CreateRolloutsOut(rollouts=out)


@router.get("/rollouts", dependencies=admin, response_model=RolloutPageOut)
async def list_rollouts(
    request: Request,
    state: State | None = None,
    group_id: Annotated[str | None, Query(max_length=200)] = None,
    cursor: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
):
    """Rollouts in creation order after `cursor`, filtered by state and/or group."""
    store = request.app.state.gateway.store
    page = store.list_rollouts(state=state, group_id=group_id, after=cursor, limit=limit)
    nxt = page[-1].seq if len(page) == limit else None
    return {"rollouts": [rollout_out(r) for r in page], "next_cursor": nxt}


@router.get("/rollouts/{rollout_id}", dependencies=admin, response_model=RolloutDetailOut)
async def get_rollout(rollout_id: RolloutIdPath, request: Request, turns: bool = True):
    """One rollout, with its turns (exact token ids, logprobs, model versions) unless turns=false."""
    store = request.app.state.gateway.store
    r = _existing(request, rollout_id)
    out = rollout_out(r)
    out["turns"] = None
    if turns:  # may be large: read off the event loop
        records = await asyncio.to_thread(store.get_turns, rollout_id)
        out["turns"] = [
            TurnOut(**{**t.__dict__, "rewards": [r.__dict__ for r in t.rewards]}) for t in records
        ]
    return out


def _check_patch(body: PatchRolloutIn, where: str = "") -> None:
    fields = body.model_fields_set - {"rollout_id"}
    if not fields:
        raise ApiError(400, f"{where}nothing to change: give state, error or reward")
    if "error" in fields and body.state is None:
        raise ApiError(400, f"{where}error is set together with a state", f"{where}error")


async def _patch(request: Request, rollout_id: str, body: PatchRolloutIn) -> RolloutRecord:
    store = request.app.state.gateway.store
    r = _existing(request, rollout_id)
    if body.state is not None:
        r = await store.set_state(rollout_id, body.state, body.error)
    if "reward" in body.model_fields_set:
        r = await store.set_reward_override(rollout_id, body.reward)
    return r


@router.patch("/rollouts/{rollout_id}", dependencies=admin, response_model=RolloutOut)
async def patch_rollout(rollout_id: RolloutIdPath, body: PatchRolloutIn, request: Request):
    """Change state (legal transitions only; 409 otherwise) and/or override the reward."""
    _check_patch(body)
    return rollout_out(await _patch(request, rollout_id, body))


@router.patch("/rollouts", dependencies=admin, response_model=PatchRolloutsOut)
async def patch_rollouts(body: PatchRolloutsIn, request: Request):
    """Many PATCH /rollouts/{id} in one call (a runner ending a wave of rollouts). A malformed
    item fails the whole call (400, naming its index) and changes nothing; an unknown rollout or
    an illegal state change fails only its own item (status 404 / 409 in its result)."""
    seen: set[str] = set()
    for k, item in enumerate(body.rollouts):
        _check_patch(item, f"rollouts[{k}].")
        if item.rollout_id in seen:
            raise ApiError(400, f"rollouts[{k}].rollout_id {item.rollout_id!r} appears twice in "
                           "the batch", f"rollouts[{k}].rollout_id")
        seen.add(item.rollout_id)

    async def one(item) -> PatchResultOut:
        try:
            r = await _patch(request, item.rollout_id, item)
        except UnknownRollout as e:
            return PatchResultOut(status=404, rollout=None, error=str(e))
        except (IllegalTransition, RolloutEnded, RolloutConflict) as e:
            return PatchResultOut(status=409, rollout=None, error=str(e))
        return PatchResultOut(status=200, rollout=RolloutOut(**rollout_out(r)), error=None)

    # Concurrent: the store commits the writes of one event-loop turn together.
    return PatchRolloutsOut(rollouts=list(await asyncio.gather(*(one(i) for i in body.rollouts))))


@router.delete("/rollouts/{rollout_id}", dependencies=admin, status_code=204)
async def delete_rollout(rollout_id: RolloutIdPath, request: Request):
    if not await request.app.state.gateway.store.delete_rollout(rollout_id):
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")
    return Response(status_code=204)


@router.post("/rollouts/{rollout_id}/rewards", response_model=EventOut)
async def post_reward(
    body: RewardIn,
    request: Request,
    rollout: RolloutHead = Depends(rollout_access),
    who: Principal = Depends(principal),
):
    """Record a reward; the rollout's reward is its last one (unless the trainer overrides it)."""
    store = request.app.state.gateway.store
    e = await store.add_event(
        rollout.rollout_id, "reward", body.info, reward=body.reward, allow_ended=who.admin
    )
    return event_out(e)


@router.post("/rollouts/{rollout_id}/turn-rewards", response_model=TurnRewardOut)
async def post_turn_reward(
    body: TurnRewardIn,
    request: Request,
    rollout: RolloutHead = Depends(rollout_access),
):
    """Give a turn a reward while the rollout runs (`turn`: its index, the latest by default;
    `name`: what it is for). The rollout's own reward stays the one POSTed to /rewards. 422 for a
    turn the rollout does not have, 409 once the rollout has ended."""
    store = request.app.state.gateway.store
    r = await store.add_turn_reward(rollout.rollout_id, body.reward, body.turn, body.name)
    return TurnRewardOut(**r.__dict__)


@router.post("/rollouts/{rollout_id}/events", response_model=EventOut)
async def post_event(
    body: EventIn,
    request: Request,
    rollout: RolloutHead = Depends(rollout_access),
    who: Principal = Depends(principal),
):
    """Record a free-form event (kind + JSON payload)."""
    if body.kind == "reward":
        raise ApiError(
            400, "kind 'reward' is reserved: POST /rollouts/{id}/rewards instead", "kind"
        )
    store = request.app.state.gateway.store
    e = await store.add_event(rollout.rollout_id, body.kind, body.payload, allow_ended=who.admin)
    return event_out(e)


@router.get("/rollouts/{rollout_id}/events", dependencies=admin, response_model=EventsOut)
async def list_events(
    rollout_id: RolloutIdPath,
    request: Request,
    kind: Annotated[str | None, Query(max_length=100)] = None,
):
    store = request.app.state.gateway.store
    _existing(request, rollout_id)
    return {"events": [event_out(e) for e in store.list_events(rollout_id, kind)]}
