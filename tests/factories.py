"""Keyword-only factories for rows the API would otherwise have to create."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.core.pg import connect_kwargs
from app.runs.models import Run
from app.runs.repository import insert_run
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

    url = maker.kw["bind"].url.render_as_string(hide_password=False)
    conn = await asyncpg.connect(**connect_kwargs(url))
    try:
        await conn.set_type_codec(
            "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
        )
        created = await insert_run(conn, project_id, RunCreate.model_validate(run_body()))
    finally:
        await conn.close()
    async with maker() as s:
        values: dict[str, Any] = {"status": status.value, **fields}
        run = (
            await s.execute(
                update(Run).where(Run.id == created["id"]).values(**values).returning(Run)
            )
        ).scalar_one()
        await s.commit()
        return run


async def add_trajectories(
    maker: async_sessionmaker[AsyncSession], run_id: uuid.UUID, step: int, count: int, **row: Any
) -> None:
    """``count`` rollouts of one group at ``step`` of the run (its project and learning key
    copied as the workers' writes copy them); ``row`` overrides columns (``reward`` …)."""
    url = maker.kw["bind"].url.render_as_string(hide_password=False)
    conn = await asyncpg.connect(**connect_kwargs(url))
    try:
        await conn.executemany(
            """
            INSERT INTO trajectories (id, run_id, project_id, learning_key, step, group_index,
                                      rollout_index, messages, reward)
            SELECT gen_random_uuid(), id, project_id, learning_key, $2, 0, $3, $4::jsonb, $5
              FROM runs WHERE id = $1
            """,
            [
                (
                    run_id,
                    step,
                    i,
                    json.dumps(row.get("messages", [{"role": "assistant", "content": "a"}])),
                    row.get("reward", 0.5),
                )
                for i in range(count)
            ],
        )
    finally:
        await conn.close()
