"""The run event log.

Readers page and stream by ``id`` and trust that, per run, ids become visible in order.
That holds because every writer appends while holding the run's row lock (a transition,
a lease renewal, a flag or the reconciler's ``FOR UPDATE`` come first in the transaction),
so two transactions writing events of one run are serialised, ids and commits alike.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from app.core.sql import json_object
from app.events.models import RunEvent
from app.events.schemas import RunEventPublic
from app.runs.status import TERMINAL, RunStatus


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


@dataclass(frozen=True, slots=True)
class RenderedEvents:
    """One page of a run's events as PostgreSQL rendered it."""

    data: str  # the events, a JSON array as RunEventPublic shows them
    has_more: bool
    last_id: int | None  # the last event served: the next page's position
    latest: int  # the run's last event id (0 before its first), from the same snapshot


async def page(
    pool: asyncpg.Pool, project_id: uuid.UUID, run_id: uuid.UUID, *, after_id: int, limit: int
) -> RenderedEvents | None:
    """The run's events with id > ``after_id``, oldest first, up to ``limit``; None when the
    project has no such run. One statement: every client of every live run polls this."""
    async with pool.acquire() as conn:
        row = await conn.fetchrow(_PAGE, run_id, project_id, after_id, limit)
    if not row["visible"]:
        return None
    return RenderedEvents(row["data"], row["fetched"] > limit, row["last_id"], row["latest"])


# An event as the API shows it, rendered by PostgreSQL: no ORM and no Python object per
# event (docs/benchmarks.md, pollers). The object is RunEventPublic's fields; `data` is the
# one column wider than its field (jsonb, the field an object).
# The run's ($1) last event id, 0 before its first: what the hub's ETags are made of
# (app/events/conditional.py). An index-only read of ix_run_events_run_id's last entry.
LATEST_EVENT = "coalesce((SELECT max(id) FROM run_events WHERE run_id = $1), 0)"

EVENT_JSON = json_object(
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
       {LATEST_EVENT} AS latest,
       (SELECT count(*) FROM page) AS fetched,
       (SELECT max(id) FROM kept) AS last_id,
       (SELECT coalesce(json_agg({EVENT_JSON} ORDER BY id), '[]'::json)::text FROM kept) AS data
"""


# Events read per statement by a stream (its catch-up, and the hub for all its subscribers).
STREAM_BATCH = 500

# The run's status and its events after a position, in one snapshot: a run that is gone is
# no row; a run with nothing new is one row of NULL events.
_STREAM = f"""
WITH run AS (SELECT status FROM runs WHERE id = $1)
SELECT run.status, e.id, e.type, e.payload
  FROM run LEFT JOIN LATERAL (
       SELECT id, type, {EVENT_JSON}::text AS payload
         FROM run_events
        WHERE run_id = $1 AND id > $2
        ORDER BY id
        LIMIT $3
  ) AS e ON true
 ORDER BY e.id
"""


@dataclass(frozen=True, slots=True)
class StreamBatch:
    """Events of one run after a position, each rendered as one Server-Sent Event, and the
    run's status read in the same snapshot: a terminal status comes with the event that
    recorded it, so a stream can end on it."""

    events: list[tuple[int, str]]  # (event id, the whole SSE message)
    status: str | None  # None once the run is gone
    chunk: bytes  # every message, encoded: what each subscriber is sent, made once

    @property
    def last(self) -> bool:
        """Nothing can follow: the run ended (or is gone) and the read was not cut short."""
        ended = self.status is None or RunStatus(self.status) in TERMINAL
        return ended and len(self.events) < STREAM_BATCH

    def end(self) -> bytes:
        """The stream's last message: `end` with the run's final status."""
        return f"event: end\ndata: {json.dumps({'status': self.status})}\n\n".encode()


async def stream_read(pool: asyncpg.Pool, run_id: uuid.UUID, after_id: int) -> StreamBatch:
    """Up to STREAM_BATCH events of the run with id > ``after_id``, rendered for SSE."""
    rows = await pool.fetch(_STREAM, run_id, after_id, STREAM_BATCH)
    if not rows:
        return StreamBatch([], None, b"")
    events = [
        (row["id"], f"id: {row['id']}\nevent: {row['type']}\ndata: {row['payload']}\n\n")
        for row in rows
        if row["id"] is not None
    ]
    return StreamBatch(events, rows[0]["status"], "".join(m for _, m in events).encode())
