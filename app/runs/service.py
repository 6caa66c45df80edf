"""Run use cases shared by the API and the workers. Nothing here commits a session: the
caller's commits at the edge (a create with an ``Idempotency-Key`` is the one transaction
owned here, on a plain connection, since only it knows when to roll back).

Creating a run is one hand-written statement (:mod:`app.runs.repository`); here it gets its
``Idempotency-Key`` handling. Stop requests (cancel, pause) and resume take the run's row
lock first, so what they read cannot change under them and they never lose a race to the
worker moving the run: a live run can always be cancelled or paused.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import asyncpg
from pydantic.main import IncEx
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.catalog.policy import GRPO_NAMING, NAMING, CodePolicy
from app.core import idempotency
from app.core.domain import NotFound
from app.events import service as events
from app.runs import repository
from app.runs.lifecycle.dispatch import mark_due
from app.runs.lifecycle.leases import lease_is_live
from app.runs.lifecycle.state import TransitionConflict, transition
from app.runs.lifecycle.status import TERMINAL, RunStatus
from app.runs.models import Run
from app.runs.schemas import RunPublic
from app.runs.spec.body import RunCreate


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


# What of a run body the code policy reads: the fields that can name code, hosts or folders.
_NAMING: dict[str, IncEx | bool] = {**dict.fromkeys(NAMING, True), "grpo": set(GRPO_NAMING)}


def check_policy(policy: CodePolicy, body: RunCreate) -> None:
    """Raise NotInCatalog (a 422 naming the field) if ``body`` names what ``policy`` does not
    allow; the worker checks the stored run again (app.catalog.policy)."""
    policy.check(body.model_dump(include=_NAMING))


async def create_run(
    conn: asyncpg.Connection,
    project_id: uuid.UUID,
    body: RunCreate,
    *,
    policy: CodePolicy,
    max_active: int,
    due: Callable[[], None],
    idempotency_key: str | None = None,
) -> RunPublic | idempotency.Replay:
    """Create the run (queued once committed), or replay the first answer given to the
    same ``Idempotency-Key``. The key is stored with the run in one transaction; a key
    already answered replays that answer (even at the active-run cap), and a concurrent
    duplicate waits on the key until the first request ends, then replays it. A run that
    names what the code ``policy`` does not allow is refused before anything is written.
    ``due`` wakes the reconciler, called once a new run committed.
    """
    check_policy(policy, body)
    if idempotency_key is None:
        row = await repository.insert_run(conn, project_id, body, max_active=max_active)
        due()
        return RunPublic.model_validate(row)
    fingerprint = idempotency.request_fingerprint(body.model_dump(mode="json"))
    earlier = await idempotency.replay(conn, project_id, idempotency_key, fingerprint)
    if earlier is not None:
        return earlier
    transaction = conn.transaction(isolation="read_committed")
    await transaction.start()
    try:
        run = RunPublic.model_validate(
            await repository.insert_run(conn, project_id, body, max_active=max_active)
        )
        stored = await idempotency.record(
            conn, project_id, idempotency_key, fingerprint, 202, run.model_dump(mode="json")
        )
    except repository.ActiveRunLimit:
        await transaction.rollback()
        # A duplicate that waited at the cap behind the request that took the last slot
        # with this key still gets that request's answer.
        first = await idempotency.replay(conn, project_id, idempotency_key, fingerprint)
        if first is None:
            raise
        return first
    except BaseException:
        await transaction.rollback()
        raise
    if stored:
        await transaction.commit()
        due()
        return run
    # Another request with this key committed first: this run never existed.
    await transaction.rollback()
    first = await idempotency.replay(conn, project_id, idempotency_key, fingerprint)
    assert first is not None, "the key was taken by a committed request"
    return first


async def fetch_run(
    conn: asyncpg.Connection, project_id: uuid.UUID, run_id: uuid.UUID
) -> RunPublic:
    """The run as the API shows it (one statement on a plain connection: the polled path)."""
    row = await repository.fetch_run(conn, project_id, run_id)
    if row is None:
        raise NotFound("Run")
    return RunPublic.model_validate(row)


async def _locked(session: AsyncSession, project_id: uuid.UUID, run_id: uuid.UUID) -> Run:
    """The project's run, its row locked until the transaction ends."""
    run = (
        await session.execute(
            select(Run)
            .where(col(Run.id) == run_id, col(Run.project_id) == project_id)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    ).scalar_one_or_none()
    if run is None:
        raise NotFound("Run")
    return run


async def _set_flag(session: AsyncSession, run: Run, flag: str, value: bool, message: str) -> Run:
    """Set or clear a stop flag the holding worker reads at its next heartbeat."""
    await session.execute(update(Run).where(col(Run.id) == run.id).values({flag: value}))
    event = flag if value else "pause_withdrawn"
    await events.append(session, run.id, event, message)
    refreshed = await session.get(Run, run.id, populate_existing=True)
    assert refreshed is not None
    return refreshed


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
    next heartbeat. Asking again is a no-op; asking a finished run is a conflict."""
    run = await _locked(session, project_id, run_id)
    status = RunStatus(run.status)
    if status == target or (getattr(run, flag) and status not in TERMINAL):
        return run
    if status in TERMINAL:
        raise TransitionConflict(run_id, f"A {status.value} run cannot be {verb}.", current=status)
    if await lease_is_live(session, run_id):
        return await _set_flag(session, run, flag, True, f"{flag.replace('_', ' ')}; {when}")
    return await transition(session, run_id, target, expected=status, message=f"{verb} by user")


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
    run = await _locked(session, project_id, run_id)
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
        return await _set_flag(session, run, "pause_requested", False, "pause request withdrawn")
    raise TransitionConflict(
        run_id, f"Only a paused run can be resumed; this one is {status.value}.", current=status
    )
