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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg
from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.auth.models import ApiKey, Project
from app.auth.roles import Role
from app.core.time import utcnow

log = logging.getLogger(__name__)

KEY_PREFIX = "ty_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: one key of one project, and what it may do there."""

    project_id: uuid.UUID
    key_id: uuid.UUID
    role: Role


async def get_or_create_project(session: AsyncSession, name: str) -> Project:
    await session.execute(insert(Project).values(name=name).on_conflict_do_nothing())
    return (await session.execute(select(Project).where(col(Project.name) == name))).scalar_one()


# The role of a key made without naming one: enough to run things, not to change where the
# project's events go (webhooks). `trainyard up` asks for admin for its user.
DEFAULT_ROLE = Role.member


async def create_key(
    session: AsyncSession,
    project: Project,
    *,
    name: str | None = None,
    role: Role = DEFAULT_ROLE,
) -> tuple[ApiKey, str]:
    """A new key for ``project`` with ``role``; returns the row and the plain key (never
    stored)."""
    plain = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(
        project_id=project.id,
        name=name,
        prefix=plain[:10],
        key_hash=hash_key(plain),
        role=Role(role),
    )
    session.add(key)
    await session.flush()
    return key, plain


async def key_and_project(
    session: AsyncSession, key_id: uuid.UUID
) -> tuple[ApiKey, Project] | None:
    """The key ``key_id`` and its project (None if the key is gone)."""
    row = (
        await session.execute(
            select(ApiKey, Project)
            .join(Project, col(Project.id) == col(ApiKey.project_id))
            .where(col(ApiKey.id) == key_id)
        )
    ).one_or_none()
    return None if row is None else (row[0], row[1])


async def revoke_key(session: AsyncSession, key_id: uuid.UUID) -> bool:
    result = await session.execute(
        update(ApiKey)
        .where(col(ApiKey.id) == key_id, col(ApiKey.revoked_at).is_(None))
        .values(revoked_at=utcnow())
    )
    return bool(getattr(result, "rowcount", 0))


async def list_keys(
    session: AsyncSession, *, project: str | None = None
) -> list[tuple[ApiKey, str]]:
    """Every key (optionally of the project named ``project``) with its project's name,
    newest first. Only what is stored: a key's hash and first characters, never the key."""
    query = (
        select(ApiKey, col(Project.name))
        .join(Project, col(Project.id) == col(ApiKey.project_id))
        .order_by(col(ApiKey.created_at).desc(), col(ApiKey.id))
    )
    if project is not None:
        query = query.where(col(Project.name) == project)
    return [(key, name) for key, name in (await session.execute(query)).all()]


class KeyCache:
    """Recently verified keys, so a request costs no extra query.

    A revoked key stops working within ``ttl`` seconds in every API process. Concurrent
    misses for one key share a single lookup, so an expiry does not stampede the database
    (docs/benchmarks.md, "Where the time went"). Written here because nothing installed does
    that second part: cachetools has TTL maps but no shared async miss.
    """

    def __init__(self, ttl: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[Principal, float]] = {}
        self._loading: dict[str, asyncio.Task[Principal | None]] = {}

    def get(self, digest: str) -> Principal | None:
        hit = self._entries.get(digest)
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]

    async def load(
        self, digest: str, lookup: Callable[[], Awaitable[Principal | None]]
    ) -> Principal | None:
        """After a miss: ``lookup()``'s answer, shared by every request that missed meanwhile.

        The lookup runs as a task of its own, so a request that gives up (a client that hung
        up) does not take the answer away from the others waiting on it.
        """
        task = self._loading.get(digest)
        if task is None:
            task = asyncio.ensure_future(self._load(digest, lookup))
            # Retrieved here too, in case every request waiting on it has given up.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._loading[digest] = task
        return await asyncio.shield(task)

    async def _load(
        self, digest: str, lookup: Callable[[], Awaitable[Principal | None]]
    ) -> Principal | None:
        try:
            principal = await lookup()
            if principal is not None:  # unknown keys are not cached: they may be created
                self._put(digest, principal)
            return principal
        finally:
            del self._loading[digest]

    def _put(self, digest: str, principal: Principal) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # bounded memory; each live key costs one query to refill
        self._entries[digest] = (principal, time.monotonic() + self.ttl)

    def clear(self) -> None:
        self._entries.clear()


_LOOKUP = (
    "SELECT id, project_id, role, last_used_at < now() - interval '60 seconds'"
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
    return await cache.load(digest, lambda: _lookup(pool, digest))


async def _lookup(pool: asyncpg.Pool, digest: str) -> Principal | None:
    async with pool.acquire() as conn:
        row = await conn.fetchrow(_LOOKUP, digest)
    if row is None:
        return None
    principal = Principal(project_id=row["project_id"], key_id=row["id"], role=Role(row["role"]))
    if row["stale"]:
        # last_used_at is informational: refreshed at most once a minute, off the request
        # path, so a lookup is no write.
        task = asyncio.create_task(_touch(pool, principal.key_id))
        _background.add(task)
        task.add_done_callback(_background.discard)
    return principal


async def _touch(pool: asyncpg.Pool, key_id: uuid.UUID) -> None:
    try:
        async with pool.acquire() as conn:
            await conn.execute(_TOUCH, key_id)
    except Exception:
        log.warning("could not record last use of key %s", key_id, exc_info=True)
