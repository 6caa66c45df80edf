"""Keyword-only factories for rows the API would otherwise have to create."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.runs import service
from app.runs.models import Run
from app.runs.schemas import RunCreate
from app.runs.status import RunStatus


async def create_run(
    maker: async_sessionmaker[AsyncSession],
    *,
    project_id: uuid.UUID,
    status: RunStatus = RunStatus.PENDING,
    **fields: Any,
) -> Run:
    """A committed run, forced into ``status`` (bypassing the state machine on purpose)."""
    from tests.conftest import run_body

    async with maker() as s:
        run = await service.create_run(s, project_id, RunCreate.model_validate(run_body()))
        values: dict[str, Any] = {"status": status.value, **fields}
        run = (
            await s.execute(update(Run).where(Run.id == run.id).values(**values).returning(Run))
        ).scalar_one()
        await s.commit()
        return run
