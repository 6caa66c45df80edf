"""The run event log.

Readers page and stream by ``id`` and trust that, per run, ids become visible in order.
That holds because every writer appends while holding the run's row lock (a transition,
a lease renewal, a flag or the reconciler's ``FOR UPDATE`` come first in the transaction),
so two transactions writing events of one run are serialised, ids and commits alike.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.events.models import RunEvent


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
