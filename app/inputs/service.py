from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.inputs.models import TaskInput


async def list_after(
    session: AsyncSession,
    run_id: uuid.UUID,
    *,
    split: str | None,
    after_index: int | None,
    limit: int,
) -> list[TaskInput]:
    """The run's training inputs by index (one ``split`` or both), after ``after_index``."""
    query = select(TaskInput).where(col(TaskInput.run_id) == run_id)
    if split is not None:
        query = query.where(col(TaskInput.split) == split)
    if after_index is not None:
        query = query.where(col(TaskInput.index) > after_index)
    query = query.order_by(col(TaskInput.index)).limit(limit)
    return list((await session.execute(query)).scalars())
