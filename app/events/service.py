"""The run event log.

Readers page and stream by ``id`` and trust that, per run, ids become visible in order.
That holds because every writer appends while holding the run's row lock (a transition,
a lease renewal, a flag or the reconciler's ``FOR UPDATE`` come first in the transaction),
so two transactions writing events of one run are serialised, ids and commits alike.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.core.sql import json_object
from app.events.models import RunEvent
from app.events.schemas import RunEventPublic
from app.runs.models import Run


async def append(
    session: AsyncSession,
    run_id: uuid.UUID,
    type_: str,
    message: str,
    *,
    level: str = "info",
    data: dict[str, Any] | None = None,
) -> None:
    """Append an event; call it inside a transaction that already locked the run's row."""
    await session.execute(
        insert(RunEvent).values(
            run_id=run_id, type=type_, level=level, message=message, data=data or {}
        )
    )


async def list_after(
    session: AsyncSession, run_id: uuid.UUID, *, after_id: int, limit: int
) -> list[RunEvent]:
    """Events of one run with id > ``after_id``, oldest first (up to ``limit`` rows)."""
    return list(
        (
            await session.execute(
                select(RunEvent)
                .where(col(RunEvent.run_id) == run_id, col(RunEvent.id) > after_id)
                .order_by(col(RunEvent.id))
                .limit(limit)
            )
        ).scalars()
    )


async def stream_batch(
    session: AsyncSession, run_id: uuid.UUID, *, after_id: int, limit: int
) -> tuple[str | None, list[RunEvent]]:
    """The run's status (None once it is gone), then its events after ``after_id``: in that
    order, so a terminal status read here means its event (written in the same transaction)
    is in the batch or an earlier one, and a stream can end on it."""
    status = await session.scalar(select(col(Run.status)).where(col(Run.id) == run_id))
    return status, await list_after(session, run_id, after_id=after_id, limit=limit)


@dataclass(frozen=True, slots=True)
class RenderedEvents:
    """One page of a run's events as PostgreSQL rendered it."""

    data: str  # the events, a JSON array as RunEventPublic shows them
    has_more: bool
    last_id: int | None  # the last event served: the next page's position


async def page(
    pool: asyncpg.Pool, project_id: uuid.UUID, run_id: uuid.UUID, *, after_id: int, limit: int
) -> RenderedEvents | None:
    """The run's events with id > ``after_id``, oldest first, up to ``limit``; None when the
    project has no such run. One statement: every client of every live run polls this."""
    async with pool.acquire() as conn:
        row = await conn.fetchrow(_PAGE, run_id, project_id, after_id, limit)
    if not row["visible"]:
        return None
    return RenderedEvents(row["data"], row["fetched"] > limit, row["last_id"])


# A page of events as the API shows them, rendered by PostgreSQL: no ORM and no Python
# object per event (docs/benchmarks.md, pollers). The object is RunEventPublic's fields;
# `data` is the one column wider than its field (jsonb, the field an object).
_EVENT = json_object(
    RunEventPublic,
    {"data": "CASE jsonb_typeof(data) WHEN 'object' THEN data ELSE '{}'::jsonb END"},
)
_PAGE = f"""
WITH run AS (
    SELECT id FROM runs WHERE id = $1 AND project_id = $2
), page AS (
    SELECT e.id, e.run_id, e.type, e.level, e.message, e.data, e.created_at
      FROM run_events AS e JOIN run ON e.run_id = run.id
     WHERE e.id > $3
     ORDER BY e.id
     LIMIT $4 + 1
), kept AS (
    SELECT * FROM page ORDER BY id LIMIT $4
)
SELECT EXISTS (SELECT 1 FROM run) AS visible,
       (SELECT count(*) FROM page) AS fetched,
       (SELECT max(id) FROM kept) AS last_id,
       (SELECT coalesce(json_agg({_EVENT} ORDER BY id), '[]'::json)::text FROM kept) AS data
"""
