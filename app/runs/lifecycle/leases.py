"""Leases: which worker holds a run, until when, under which fencing token (``attempt``).

Postgres decides who works on a run, not the broker: Celery may deliver a task twice or
lose it. A worker claims the run (one wins), renews the lease by heartbeat, and every write
it makes is fenced on (``lease_owner``, ``attempt``): after its lease was taken over, a
paused or partitioned worker can change nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.events import service as events
from app.events.models import RunEvent
from app.runs.lifecycle.dispatch import mark_due
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.state import LeaseLost, transition
from app.runs.lifecycle.status import CLAIMABLE, TERMINAL, RunStatus
from app.runs.models import Run


def _claimable() -> list[str]:
    return [s.value for s in CLAIMABLE]


async def claim(
    session: AsyncSession,
    run_id: uuid.UUID,
    *,
    owner: str,
    ttl_seconds: float,
    max_attempts: int,
) -> tuple[Run, Fence] | None:
    """Take the run if nobody holds a live lease on it; None if it is not ours to run.

    Taking over a lease that ran out counts a failure of the worker that held it; a run
    whose failures reached ``max_attempts`` is failed here instead of being run again.
    A run given back cleanly (paused, resumed, handed over) costs no attempt.
    """
    taken_over = case((col(Run.lease_owner).is_not(None), 1), else_=0)
    claimed = (
        await session.execute(
            update(Run)
            .where(
                col(Run.id) == run_id,
                col(Run.status).in_(_claimable()),
                col(Run.cancel_requested).is_(False),
                col(Run.pause_requested).is_(False),
                (col(Run.lease_owner).is_(None)) | (col(Run.lease_expires_at) < func.now()),
                col(Run.failures) + taken_over < max_attempts,
            )
            .values(
                lease_owner=owner,
                lease_expires_at=func.now() + timedelta(seconds=ttl_seconds),
                attempt=Run.attempt + 1,
                failures=Run.failures + taken_over,
            )
            .returning(Run)
            .execution_options(synchronize_session=False, populate_existing=True)
        )
    ).scalar_one_or_none()
    if claimed is not None:
        await events.append(
            session,
            run_id,
            "lease",
            f"claimed by {owner} (attempt {claimed.attempt})",
            data={"owner": owner, "attempt": claimed.attempt, "failures": claimed.failures},
        )
        return claimed, Fence(owner=owner, attempt=claimed.attempt)

    run = await session.get(Run, run_id, populate_existing=True)
    if run is None or run.status not in CLAIMABLE or await lease_is_live(session, run_id):
        return None
    failures = run.failures + (run.lease_owner is not None)
    if failures >= max_attempts:
        await transition(
            session,
            run_id,
            RunStatus.FAILED,
            expected=RunStatus(run.status),
            error=await gave_up(session, run_id, failures),
            values={"failures": failures},
        )
    return None


async def gave_up(session: AsyncSession, run_id: uuid.UUID, failures: int) -> str:
    """Why a run is failed after ``failures`` attempts: with the last reason an attempt
    ended for, where one said (a rank died, a vLLM server gone)."""
    last = await session.scalar(
        select(col(RunEvent.data)["reason"].astext)
        .where(col(RunEvent.run_id) == run_id, col(RunEvent.type) == "attempt_ended")
        .order_by(col(RunEvent.id).desc())
        .limit(1)
    )
    why = f"the last ended: {last}" if last else "the worker died or lost its lease on each"
    return f"gave up after {failures} failed attempts; {why}"


async def lease_is_live(session: AsyncSession, run_id: uuid.UUID) -> bool:
    return bool(
        await session.scalar(
            select(col(Run.lease_expires_at) > func.now()).where(
                col(Run.id) == run_id,
                col(Run.lease_owner).is_not(None),
            )
        )
    )


@dataclass(frozen=True)
class LeaseState:
    """What a heartbeat learns: the run's status and whether someone asked it to stop."""

    status: RunStatus
    cancel_requested: bool
    pause_requested: bool


async def renew(
    session: AsyncSession, run_id: uuid.UUID, fence: Fence, *, ttl_seconds: float
) -> LeaseState:
    """Extend the lease; raises :class:`LeaseLost` if this worker no longer holds it."""
    row = (
        await session.execute(
            update(Run)
            .where(
                col(Run.id) == run_id,
                col(Run.lease_owner) == fence.owner,
                col(Run.attempt) == fence.attempt,
                col(Run.status).not_in([s.value for s in TERMINAL]),
            )
            .values(lease_expires_at=func.now() + timedelta(seconds=ttl_seconds))
            .returning(col(Run.status), col(Run.cancel_requested), col(Run.pause_requested))
        )
    ).first()
    if row is None:
        raise LeaseLost(run_id)
    return LeaseState(RunStatus(row.status), row.cancel_requested, row.pause_requested)


async def observe(session: AsyncSession, run_id: uuid.UUID, fence: Fence) -> LeaseState:
    """What :func:`renew` would learn, without extending the lease: for the ranks of a
    distributed training, whose worker holds and renews it. Raises :class:`LeaseLost` once
    the lease is not ``fence``'s, or ran out (the worker stopped renewing it)."""
    row = (
        await session.execute(
            select(col(Run.status), col(Run.cancel_requested), col(Run.pause_requested)).where(
                col(Run.id) == run_id,
                col(Run.lease_owner) == fence.owner,
                col(Run.attempt) == fence.attempt,
                col(Run.lease_expires_at) > func.now(),
                col(Run.status).not_in([s.value for s in TERMINAL]),
            )
        )
    ).first()
    if row is None:
        raise LeaseLost(run_id)
    return LeaseState(RunStatus(row.status), row.cancel_requested, row.pause_requested)


async def release(
    session: AsyncSession,
    run_id: uuid.UUID,
    fence: Fence,
    *,
    due_now: bool = False,
    failed: bool = False,
) -> bool:
    """Give the run back (it stays in its status for the next worker); False if not ours.
    ``due_now``: a worker should take it at once (this one is shutting down, or its attempt
    ended), not after ``redispatch_seconds``. ``failed``: the attempt failed (a rank of its
    training died, a vLLM server is gone) and counts towards ``max_attempts``, as a lease
    taken over does (not due now: ``redispatch_seconds`` from now); a clean hand-back counts
    none."""
    values: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None}
    if due_now:
        values["dispatched_at"] = None
    if failed:
        values["failures"] = Run.failures + 1
        if not due_now:  # re-published after redispatch_seconds from now, not at once
            values["dispatched_at"] = func.now()
    result = await session.execute(
        update(Run)
        .where(
            col(Run.id) == run_id,
            col(Run.lease_owner) == fence.owner,
            col(Run.attempt) == fence.attempt,
        )
        .values(**values)
    )
    released = bool(getattr(result, "rowcount", 0))
    if released and due_now:
        await mark_due(session, run_id)
    return released
