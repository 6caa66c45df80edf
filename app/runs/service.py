"""Run use cases shared by the API and the workers. Nothing here commits.

Creating a run lives in :mod:`app.runs.repository` (one hand-written statement).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.core.errors import NotFound
from app.events.models import RunEvent
from app.runs.dispatch import mark_due
from app.runs.leases import lease_is_live
from app.runs.models import Run
from app.runs.state import TransitionConflict, transition
from app.runs.status import TERMINAL, RunStatus

# A request that loses a compare-and-set to a worker re-reads and tries again this often.
_CAS_RETRIES = 3


async def get_run(session: AsyncSession, project_id: uuid.UUID, run_id: uuid.UUID) -> Run:
    """The run, if it belongs to the project; another project's run is simply not found."""
    run = (
        await session.execute(
            select(Run).where(col(Run.id) == run_id, col(Run.project_id) == project_id)
        )
    ).scalar_one_or_none()
    if run is None:
        raise NotFound("Run")
    return run


async def ensure_run_visible(
    session: AsyncSession, project_id: uuid.UUID, run_id: uuid.UUID
) -> None:
    found = await session.scalar(
        select(col(Run.id)).where(col(Run.id) == run_id, col(Run.project_id) == project_id)
    )
    if found is None:
        raise NotFound("Run")


@dataclass(frozen=True)
class RunFilters:
    status: list[RunStatus] | None = None
    model_name: str | None = None
    learning_key: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None


async def list_runs(
    session: AsyncSession,
    project_id: uuid.UUID,
    filters: RunFilters,
    *,
    limit: int,
    after: tuple[datetime, uuid.UUID] | None,
) -> list[Run]:
    """Newest first, keyset on (created_at, id); returns up to ``limit + 1`` rows."""
    query = select(Run).where(col(Run.project_id) == project_id)
    if filters.status:
        query = query.where(col(Run.status).in_([s.value for s in filters.status]))
    if filters.model_name is not None:
        query = query.where(col(Run.model_name) == filters.model_name)
    if filters.learning_key is not None:
        query = query.where(col(Run.learning_key) == filters.learning_key)
    if filters.created_after is not None:
        query = query.where(col(Run.created_at) >= filters.created_after)
    if filters.created_before is not None:
        query = query.where(col(Run.created_at) < filters.created_before)
    if after is not None:
        query = query.where(func.row(Run.created_at, Run.id) < func.row(*after))
    query = query.order_by(col(Run.created_at).desc(), col(Run.id).desc()).limit(limit + 1)
    return list((await session.execute(query)).scalars())


async def _flag(session: AsyncSession, run: Run, *, column: str, event: str, message: str) -> Run:
    """Set a stop flag the holding worker reads at its next heartbeat (CAS on version)."""
    updated = (
        await session.execute(
            update(Run)
            .where(col(Run.id) == run.id, col(Run.version) == run.version)
            .values({column: True, "version": Run.version + 1, "updated_at": func.now()})
            .returning(Run)
            .execution_options(synchronize_session=False, populate_existing=True)
        )
    ).scalar_one_or_none()
    if updated is None:
        raise TransitionConflict(run.id, "run changed concurrently", current=None, retryable=True)
    await session.execute(insert(RunEvent).values(run_id=run.id, type=event, message=message))
    return updated


async def _with_retries(session: AsyncSession, attempt: Callable[[], Awaitable[Run]]) -> Run:
    for i in range(_CAS_RETRIES):
        try:
            async with session.begin_nested():
                return await attempt()
        except TransitionConflict as conflict:
            if not conflict.retryable or i == _CAS_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


async def _request_stop(
    session: AsyncSession,
    project_id: uuid.UUID,
    run_id: uuid.UUID,
    *,
    target: RunStatus,
    flag: str,
    verb: str,
    when: str,
) -> Run:
    """Stop now if no worker holds the run, else set ``flag`` for the holder to see at its
    next heartbeat. Asking again is a no-op; asking a finished run is a 409."""

    async def attempt() -> Run:
        run = await get_run(session, project_id, run_id)
        await session.refresh(run)
        status = RunStatus(run.status)
        if status == target or (getattr(run, flag) and status not in TERMINAL):
            return run
        if status in TERMINAL:
            raise TransitionConflict(
                run_id, f"A {status.value} run cannot be {verb}.", current=status
            )
        if await lease_is_live(session, run_id):
            return await _flag(
                session, run, column=flag, event=flag, message=f"{flag.replace('_', ' ')}; {when}"
            )
        return await transition(session, run_id, target, expected=status, message=f"{verb} by user")

    return await _with_retries(session, attempt)


async def cancel_run(session: AsyncSession, project_id: uuid.UUID, run_id: uuid.UUID) -> Run:
    """Cancel: within one heartbeat if a worker holds the run, at once otherwise."""
    return await _request_stop(
        session,
        project_id,
        run_id,
        target=RunStatus.CANCELLED,
        flag="cancel_requested",
        verb="cancelled",
        when="the worker stops at its next heartbeat",
    )


async def pause_run(session: AsyncSession, project_id: uuid.UUID, run_id: uuid.UUID) -> Run:
    """Pause: at the next step boundary (after a checkpoint) if a worker holds the run."""
    return await _request_stop(
        session,
        project_id,
        run_id,
        target=RunStatus.PAUSED,
        flag="pause_requested",
        verb="paused",
        when="the worker stops at the next step boundary",
    )


async def resume_run(session: AsyncSession, project_id: uuid.UUID, run_id: uuid.UUID) -> Run:
    """Put a paused run back in the queue (or withdraw a pause not yet taken)."""

    async def attempt() -> Run:
        run = await get_run(session, project_id, run_id)
        await session.refresh(run)
        status = RunStatus(run.status)
        if status == RunStatus.PAUSED:
            resumed = await transition(
                session,
                run_id,
                RunStatus.PENDING,
                expected=status,
                message="resumed by user",
                values={"dispatched_at": None},
            )
            await mark_due(session, run_id)
            return resumed
        if run.pause_requested and status not in TERMINAL:
            updated = (
                await session.execute(
                    update(Run)
                    .where(col(Run.id) == run_id, col(Run.version) == run.version)
                    .values(pause_requested=False, version=Run.version + 1, updated_at=func.now())
                    .returning(Run)
                    .execution_options(synchronize_session=False, populate_existing=True)
                )
            ).scalar_one_or_none()
            if updated is None:
                raise TransitionConflict(
                    run_id, "run changed concurrently", current=None, retryable=True
                )
            await session.execute(
                insert(RunEvent).values(
                    run_id=run_id, type="pause_withdrawn", message="pause request withdrawn"
                )
            )
            return updated
        raise TransitionConflict(
            run_id,
            f"Only a paused run can be resumed; this one is {status.value}.",
            current=status,
        )

    return await _with_retries(session, attempt)
