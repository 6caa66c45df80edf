"""The run event log: its one writer and its readers.

Readers page and stream by ``id`` and trust that, per run, ids become visible in order.
That holds because every insert into ``run_events`` holds the run's row lock: two
transactions writing events of one run are then serialised, ids (drawn from the sequence
at the insert) and commits alike. This module is the only place that inserts events, in two
forms, so the lock is taken by construction:

- :func:`append`, for code with an ORM session: one statement that locks the run's row
  and appends the event (the lock is cheap when the transaction holds it already).
- :func:`insert_events`, the ``INSERT`` for hand-written statements that append events in
  a CTE (a move of :mod:`app.runs.lifecycle.state`, a run's creation in :mod:`app.runs.repository`
  and :mod:`app.training_data.jsonl`). Its caller's statement must hold the lock itself.

``tests/events/test_writer.py`` fails when ``app/`` or ``workers/`` inserts events anywhere
else, and checks that concurrent writers' ids become visible in order.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncSession

from app.core.domain import NotFound
from app.core.sql import json_object
from app.events import sse
from app.events.schemas import RunEventPublic
from app.runs.lifecycle.status import TERMINAL, RunStatus


def insert_events(rows: str) -> str:
    """The ``INSERT`` of ``rows`` into the log: a ``SELECT`` or ``VALUES`` giving each event's
    ``run_id, type, level, message, data``, in the order the ids are to be drawn.

    Use it only inside a statement that holds the row lock of every run it appends to:
    a CTE that locked the row first (``SELECT … FOR UPDATE``, as a move does), or one that
    inserts the run itself (a run's creation: no other transaction can see the row, let
    alone write events for it, until this one commits). The text is the same whatever
    ``rows`` is, so a statement built with it costs what a hand-written one did."""
    return f"INSERT INTO run_events (run_id, type, level, message, data)\n    {rows}"


# FOR NO KEY UPDATE: the lock an UPDATE of the run takes. It excludes every other event
# writer (a move's FOR UPDATE, a lease's or a flag's UPDATE, another append) but not the
# FOR KEY SHARE that inserting a row which references the run takes (a trajectory, a metric).
_APPEND = text(
    f"""
WITH run AS (
    SELECT id FROM runs WHERE id = :run_id FOR NO KEY UPDATE
)
{insert_events("SELECT run.id, :type, :level, :message, CAST(:data AS jsonb) FROM run")}
RETURNING id
"""
).bindparams(bindparam("data", type_=JSONB))


async def append(
    session: AsyncSession,
    run_id: uuid.UUID,
    type_: str,
    message: str,
    *,
    level: str = "info",
    data: dict[str, Any] | None = None,
) -> int:
    """Append an event to the run's log in ``session``'s transaction, holding the run's row
    lock until it ends (one statement: the lock, cheap when already held, and the insert).
    Returns the event's id; raises NotFound when the run is gone."""
    event_id = await session.scalar(
        _APPEND,
        {"run_id": run_id, "type": type_, "level": level, "message": message, "data": data or {}},
    )
    if event_id is None:
        raise NotFound("Run")
    return int(event_id)


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


async def stream_read(pool: asyncpg.Pool, run_id: uuid.UUID, after_id: int) -> StreamBatch:
    """Up to STREAM_BATCH events of the run with id > ``after_id``, rendered for SSE."""
    rows = await pool.fetch(_STREAM, run_id, after_id, STREAM_BATCH)
    if not rows:
        return StreamBatch([], None, b"")
    events = [
        (row["id"], sse.event(row["id"], row["type"], row["payload"]))
        for row in rows
        if row["id"] is not None
    ]
    return StreamBatch(events, rows[0]["status"], "".join(m for _, m in events).encode())
