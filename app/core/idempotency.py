"""``Idempotency-Key`` storage: the first answer to a key is kept and replayed.

The key row is inserted in the same transaction as the resource it creates, so a
concurrent duplicate waits on the unique index and then replays the committed answer, and a
rolled-back create leaves no key behind.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from sqlalchemy import Column, Index, PrimaryKeyConstraint, Uuid, delete
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import Field, SQLModel, col

from app.core.columns import jsonb, timestamp
from app.core.domain import InvalidInput
from app.core.errors import KEY_REUSED
from app.core.time import utcnow

KEY_TTL = timedelta(hours=24)


class IdempotencyKey(SQLModel, table=True):
    __tablename__ = "idempotency_keys"
    __table_args__ = (
        PrimaryKeyConstraint("project_id", "key"),
        Index("ix_idempotency_keys_created", "created_at"),
    )

    project_id: uuid.UUID = Field(sa_column=Column(Uuid, nullable=False))
    key: str = Field(max_length=255)
    request_hash: str = Field(max_length=64)
    status_code: int
    response: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    created_at: datetime | None = Field(default=None, sa_column=timestamp())


def request_fingerprint(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Replay:
    status_code: int
    response: dict[str, Any]


async def record(
    conn: asyncpg.Connection,
    project_id: uuid.UUID,
    key: str,
    fingerprint: str,
    status_code: int,
    response: Any,
) -> bool:
    """Store the answer under ``key`` in the creating transaction; False if the key exists.

    On False (a request with the same key committed first: a concurrent one blocks on the
    primary key until the other ends) the caller rolls back what it created and answers
    with :func:`replay`.
    """
    inserted = await conn.fetchval(
        "INSERT INTO idempotency_keys (project_id, key, request_hash, status_code, response)"
        " VALUES ($1, $2, $3, $4, $5)"
        # An expired key (older than KEY_TTL, not yet purged) is simply taken over.
        " ON CONFLICT (project_id, key) DO UPDATE SET request_hash = EXCLUDED.request_hash,"
        " status_code = EXCLUDED.status_code, response = EXCLUDED.response, created_at = now()"
        " WHERE idempotency_keys.created_at < now() - $6::interval"
        " RETURNING true",
        project_id,
        key,
        fingerprint,
        status_code,
        response,
        KEY_TTL,
    )
    return bool(inserted)


async def replay(
    conn: asyncpg.Connection, project_id: uuid.UUID, key: str, fingerprint: str
) -> Replay | None:
    """The first answer given under ``key`` (None if the key is unused or expired); a 422
    naming the header if that request had another body."""
    row = await conn.fetchrow(
        "SELECT request_hash, status_code, response FROM idempotency_keys"
        " WHERE project_id = $1 AND key = $2 AND created_at >= now() - $3::interval",
        project_id,
        key,
        KEY_TTL,
    )
    if row is None:
        return None
    if row["request_hash"] != fingerprint:
        raise InvalidInput(
            "This Idempotency-Key was first used with another request body; use a new key.",
            field="header.Idempotency-Key",
            error_type=KEY_REUSED,
        )
    return Replay(row["status_code"], row["response"])


async def purge_expired(session: AsyncSession) -> int:
    result = await session.execute(
        delete(IdempotencyKey).where(col(IdempotencyKey.created_at) < utcnow() - KEY_TTL)
    )
    return int(getattr(result, "rowcount", 0) or 0)
