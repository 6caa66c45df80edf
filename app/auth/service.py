"""API keys: created once (the plain key is shown only then), stored as SHA-256 hashes.

Keys are 256-bit random tokens, so a fast hash is enough; there is nothing to brute-force.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

import asyncpg
from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.auth.models import ApiKey, Project
from app.core.time import utcnow

log = logging.getLogger(__name__)

KEY_PREFIX = "ty_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: one key of one project."""

    project_id: uuid.UUID
    key_id: uuid.UUID


async def get_or_create_project(session: AsyncSession, name: str) -> Project:
    await session.execute(insert(Project).values(name=name).on_conflict_do_nothing())
    return (await session.execute(select(Project).where(col(Project.name) == name))).scalar_one()


async def create_key(
    session: AsyncSession, project: Project, *, name: str | None = None
) -> tuple[ApiKey, str]:
    """A new key for ``project``; returns the row and the plain key (never stored)."""
    plain = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(project_id=project.id, name=name, prefix=plain[:10], key_hash=hash_key(plain))
    session.add(key)
    await session.flush()
    return key, plain


async def revoke_key(session: AsyncSession, key_id: uuid.UUID) -> bool:
    result = await session.execute(
        update(ApiKey)
        .where(col(ApiKey.id) == key_id, col(ApiKey.revoked_at).is_(None))
        .values(revoked_at=utcnow())
    )
    return bool(getattr(result, "rowcount", 0))


class KeyCache:
    """Recently verified keys, so a request costs no extra query.

    A revoked key stops working within ``ttl`` seconds in every API process. Concurrent
    misses for one key share a single lookup, so an expiry does not stampede the database.
    """

    def __init__(self, ttl: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[Principal, float]] = {}
        self._inflight: dict[str, asyncio.Future[Principal | None]] = {}

    def get(self, digest: str) -> Principal | None:
        hit = self._entries.get(digest)
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]

    def put(self, digest: str, principal: Principal) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[digest] = (principal, time.monotonic() + self.ttl)

    def clear(self) -> None:
        self._entries.clear()


_LOOKUP = (
    "SELECT id, project_id, last_used_at < now() - interval '60 seconds'"
    " OR last_used_at IS NULL AS stale"
    " FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL"
)
_TOUCH = "UPDATE api_keys SET last_used_at = now() WHERE id = $1"
_background: set[asyncio.Task[None]] = set()


async def authenticate(pool: asyncpg.Pool, plain: str, cache: KeyCache) -> Principal | None:
    """The key's principal, from the cache or one indexed lookup; None if unknown/revoked."""
    digest = hash_key(plain)
    principal = cache.get(digest)
    if principal is not None:
        return principal
    pending = cache._inflight.get(digest)
    if pending is not None:
        return await asyncio.shield(pending)
    future: asyncio.Future[Principal | None] = asyncio.get_running_loop().create_future()
    cache._inflight[digest] = future
    try:
        async with pool.acquire() as conn:
            row = await conn.fetchrow(_LOOKUP, digest)
        principal = Principal(project_id=row["project_id"], key_id=row["id"]) if row else None
        if principal is not None:
            cache.put(digest, principal)
            if row["stale"]:
                # last_used_at is informational: refreshed at most once a minute, off the
                # request path.
                task = asyncio.create_task(_touch(pool, principal.key_id))
                _background.add(task)
                task.add_done_callback(_background.discard)
        future.set_result(principal)
        return principal
    except BaseException as exc:
        future.set_exception(exc)
        future.exception()  # mark retrieved: waiters re-raise it themselves
        raise
    finally:
        del cache._inflight[digest]


async def _touch(pool: asyncpg.Pool, key_id: uuid.UUID) -> None:
    try:
        async with pool.acquire() as conn:
            await conn.execute(_TOUCH, key_id)
    except Exception:
        log.warning("could not record last use of key %s", key_id, exc_info=True)
