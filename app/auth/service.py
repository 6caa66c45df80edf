"""API keys: created once (the plain key is shown only then), stored as SHA-256 hashes.

Keys are 256-bit random tokens, so a fast hash is enough; there is nothing to brute-force.
"""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from app.auth.models import ApiKey, Project
from app.core.time import utcnow

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
    return (await session.execute(select(Project).where(Project.name == name))).scalar_one()


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
        .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))  # type: ignore[union-attr]
        .values(revoked_at=utcnow())
    )
    return bool(getattr(result, "rowcount", 0))


class KeyCache:
    """Recently verified keys, so a GET costs one query, not two.

    A revoked key stops working within ``ttl`` seconds in every API process.
    """

    def __init__(self, ttl: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[Principal, float]] = {}

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


async def authenticate(session: AsyncSession, plain: str, cache: KeyCache) -> Principal | None:
    digest = hash_key(plain)
    principal = cache.get(digest)
    if principal is not None:
        return principal
    row = (
        await session.execute(
            update(ApiKey)
            .where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None))  # type: ignore[union-attr]
            .values(last_used_at=utcnow())
            .returning(ApiKey.id, ApiKey.project_id)
        )
    ).first()
    await session.commit()
    if row is None:
        return None
    principal = Principal(project_id=row.project_id, key_id=row.id)
    cache.put(digest, principal)
    return principal
