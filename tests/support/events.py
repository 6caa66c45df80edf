"""Run events as the writers append them, for the event hub's tests."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sqlalchemy import text

from app.events.fanout import EventHub
from tests.support.runs import run_body


async def new_run(client: Any, tenant: Any) -> uuid.UUID:
    answer = await client.post("/runs", json=run_body(), headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    return uuid.UUID(answer.json()["id"])


async def append_events(
    sessionmaker: Any, run_id: uuid.UUID, n: int, *, end: bool = False
) -> list[int]:
    """``n`` events in one transaction holding the run's row lock, as every writer appends;
    with ``end`` the run is cancelled in the same transaction."""
    async with sessionmaker() as s, s.begin():
        await s.execute(text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": run_id})
        ids = (
            await s.execute(
                text(
                    "INSERT INTO run_events (run_id, type, level, message, data)"
                    " SELECT :id, 'log', 'info', 'event ' || g, '{}'::jsonb"
                    " FROM generate_series(1, :n) AS g RETURNING id"
                ),
                {"id": run_id, "n": n},
            )
        ).scalars()
        if end:
            await s.execute(
                text("UPDATE runs SET status = 'cancelled' WHERE id = :id"), {"id": run_id}
            )
        return sorted(ids)


async def event_ids(sessionmaker: Any, run_id: uuid.UUID) -> list[int]:
    async with sessionmaker() as s:
        rows = await s.execute(
            text("SELECT id FROM run_events WHERE run_id = :id ORDER BY id"), {"id": run_id}
        )
        return list(rows.scalars())


async def hub_listening(hub: EventHub) -> None:
    async with asyncio.timeout(10):
        await hub.listening()
