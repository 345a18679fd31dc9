"""Keys: one admin key for the trainer and operators, and one key per rollout for its agent.

A rollout key is derived, not stored: key = "ttr-" + base64url(HMAC-SHA256(admin_key, salt || id))
with a random per-rollout salt. The store keeps the salt and sha256(key); the key itself is never
written anywhere. Creating the same rollout again (a retried batch) derives the same key, so
idempotent creation hands back a working key without ever storing one.

Who may call what:
    no key, or a key that is neither       -> 401
    admin key                              -> every route
    rollout key of rollout R               -> R's model routes and R's reward/event posts; 403 else
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, Security
from fastapi.security import HTTPBearer

from tracetrain.gateway.schemas.base import ID_PATTERN
from tracetrain.store import RolloutHead

ROLLOUT_KEY_PREFIX = "ttr-"
_bearer = HTTPBearer(auto_error=False, description="the admin key or a rollout's key")


def new_salt() -> bytes:
    return secrets.token_bytes(16)


def derive_rollout_key(admin_key: str, rollout_id: str, salt: bytes) -> str:
    mac = hmac.new(
        admin_key.encode(), b"tracetrain rollout key\0" + salt + rollout_id.encode(), "sha256"
    )
    return ROLLOUT_KEY_PREFIX + base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: the admin, or the agent of `rollout` (looked up by its key's hash)."""

    admin: bool
    rollout: RolloutHead | None = None


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})


def identify(gw, authorization: str | None) -> Principal:
    """The caller behind an `Authorization: Bearer <key>` header (401 if none or unknown)."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if hmac.compare_digest(key.encode(), gw.admin_key.encode()):
        return Principal(admin=True)
    if key.startswith(ROLLOUT_KEY_PREFIX):
        digest = hash_key(key)
        rollout = gw.store.head_by_key_hash(digest)
        if rollout is not None and hmac.compare_digest(rollout.key_hash, digest):
            return Principal(admin=False, rollout=rollout)
    raise _unauthorized("invalid API key")


def rollout_for(gw, who: Principal, rollout_id: str) -> RolloutHead:
    """The rollout named in the path, for the admin or for that rollout's own key (else 403/404)."""
    if not who.admin:
        if who.rollout.rollout_id != rollout_id:
            raise HTTPException(403, "this key belongs to another rollout")
        return who.rollout
    rollout = gw.store.get_head(rollout_id)
    if rollout is None:
        raise HTTPException(404, f"rollout {rollout_id!r} does not exist")
    return rollout


# FastAPI dependencies (the Security(_bearer) puts the bearer scheme in the OpenAPI schema).


async def principal(request: Request, _: object = Security(_bearer)) -> Principal:
    return identify(request.app.state.gateway, request.headers.get("authorization"))


async def require_admin(who: Principal = Depends(principal)) -> Principal:
    if not who.admin:
        raise HTTPException(403, "this route needs the admin key; a rollout key cannot call it")
    return who


RolloutIdPath = Annotated[str, Path(min_length=1, max_length=200, pattern=ID_PATTERN)]


async def rollout_access(
    rollout_id: RolloutIdPath, request: Request, who: Principal = Depends(principal)
) -> RolloutHead:
    return rollout_for(request.app.state.gateway, who, rollout_id)
