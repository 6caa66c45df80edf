"""Reading trajectories: a run's rollouts in training order, and the project's training data
through the library's queries (``app.training_data.queries``), one pooled connection each."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime

import asyncpg
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.training_data import queries
from app.training_data.filters import Filters, Order, tool_calls_sql
from app.training_data.records import TrainingTrajectory
from app.trajectories.models import Trajectory

RunPosition = tuple[int, int, int]  # (step, group_index, rollout_index)


async def list_for_run(
    session: AsyncSession,
    run_id: uuid.UUID,
    *,
    step: int | None,
    min_reward: float | None,
    max_reward: float | None,
    min_tool_calls: int | None = None,
    after: RunPosition | None,
    limit: int,
) -> list[Trajectory]:
    """The run's trajectories by (step, group, rollout) after ``after``, by reward bounds
    and the tool calls of their episodes."""
    query = select(Trajectory).where(col(Trajectory.run_id) == run_id)
    if step is not None:
        query = query.where(col(Trajectory.step) == step)
    if min_reward is not None:
        query = query.where(col(Trajectory.reward) >= min_reward)
    if max_reward is not None:
        query = query.where(col(Trajectory.reward) <= max_reward)
    if min_tool_calls is not None:
        calls = text(f"{tool_calls_sql('trajectories')} >= :min_tool_calls")
        query = query.where(calls.bindparams(min_tool_calls=min_tool_calls))
    order = (col(Trajectory.step), col(Trajectory.group_index), col(Trajectory.rollout_index))
    if after is not None:
        query = query.where(func.row(*order) > func.row(*after))
    return list((await session.execute(query.order_by(*order).limit(limit))).scalars())


async def page(
    pool: asyncpg.Pool,
    filters: Filters,
    *,
    include_messages: bool,
    include_metadata: bool,
    order: Order,
    after: tuple[datetime, uuid.UUID] | None,
    limit: int,
) -> list[TrainingTrajectory]:
    """Up to ``limit`` matching trajectories in ``order``, after the keyset ``after``."""
    async with pool.acquire() as conn:
        return await queries.fetch_trajectories(
            conn,
            filters,
            include_messages=include_messages,
            include_metadata=include_metadata,
            order=order,
            after=after,
            limit=limit,
        )


async def count(pool: asyncpg.Pool, filters: Filters) -> int:
    async with pool.acquire() as conn:
        return await queries.count_trajectories(conn, filters)


async def get(
    pool: asyncpg.Pool, project_id: uuid.UUID, trajectory_id: uuid.UUID
) -> TrainingTrajectory | None:
    async with pool.acquire() as conn:
        return await queries.fetch_trajectory(conn, trajectory_id, project_ids=[project_id])


async def jsonl(
    pool: asyncpg.Pool,
    filters: Filters,
    *,
    include_messages: bool,
    include_metadata: bool,
    order: Order,
    limit: int | None,
) -> AsyncIterator[str]:
    """The matching trajectories as JSON Lines, chunk by chunk as PostgreSQL renders them;
    the connection is held while the caller iterates."""
    async with pool.acquire() as conn:
        async for chunk in queries.jsonl_chunks(
            conn,
            filters,
            include_messages=include_messages,
            include_metadata=include_metadata,
            order=order,
            limit=limit,
        ):
            yield chunk
