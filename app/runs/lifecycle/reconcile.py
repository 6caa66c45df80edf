"""The reconciler: Postgres knows which runs are due; make the broker know it too.

Runs that nobody holds (no lease, or an expired one) and that were not dispatched recently
are re-published. This one sweep covers every way a task goes missing: a crash between
commit and publish, a broker that was down or flushed, a worker killed mid-task. On the way
it applies stop requests the dead holder never saw and fails runs out of attempts.
Safe to run in every worker at once: rows are taken with ``FOR UPDATE SKIP LOCKED``.

One pass is one transaction: :func:`sweep`, then the due runs published while their rows
are still locked, then :func:`stamp_dispatched` for those the broker took, then the commit.
A process that dies anywhere in it leaves every run it had not stamped due for the next
sweep of any worker: a task published twice is harmless (the lease decides who runs), a run
stamped but never published would wait ``redispatch_seconds``. A worker's claim of a run
being published waits on the row lock for the commit; so does a cancel or pause of it. A
broker that hangs holds those locks at most its publish timeout (workers/celery_app.py:
``socket_timeout`` 5 s, one retry), and the pass stops publishing at its first failure.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.events import service as events
from app.runs.lifecycle.leases import gave_up
from app.runs.lifecycle.state import TransitionConflict, transition
from app.runs.lifecycle.status import CLAIMABLE, RunStatus
from app.runs.models import Run


@dataclass
class Sweep:
    dispatch: list[uuid.UUID] = field(default_factory=list)
    failed: list[uuid.UUID] = field(default_factory=list)
    cancelled: list[uuid.UUID] = field(default_factory=list)
    paused: list[uuid.UUID] = field(default_factory=list)


async def sweep(
    session: AsyncSession,
    *,
    redispatch_after_seconds: float,
    max_attempts: int,
    batch: int = 100,
) -> Sweep:
    """One pass over unheld live runs: stop requests applied, runs out of attempts failed,
    expired leases cleared; ``dispatch`` the runs to publish, then stamp."""
    now = func.now()
    rows = (
        await session.execute(
            select(Run)
            .where(
                col(Run.status).in_([s.value for s in CLAIMABLE]),
                or_(col(Run.lease_owner).is_(None), col(Run.lease_expires_at) < now),
                or_(
                    col(Run.dispatched_at).is_(None),
                    col(Run.dispatched_at) < now - timedelta(seconds=redispatch_after_seconds),
                    col(Run.lease_owner).is_not(None),
                    col(Run.cancel_requested),
                    col(Run.pause_requested),
                ),
            )
            .order_by(col(Run.dispatched_at).asc().nulls_first())
            .limit(batch)
            .with_for_update(skip_locked=True)
        )
    ).scalars()
    result = Sweep()
    for run in list(rows):
        status = RunStatus(run.status)
        expired = run.lease_owner is not None
        try:
            if run.cancel_requested:
                await transition(
                    session,
                    run.id,
                    RunStatus.CANCELLED,
                    expected=status,
                    message="cancelled (its worker was gone before it saw the request)",
                )
                result.cancelled.append(run.id)
                continue
            if run.pause_requested:
                await transition(
                    session,
                    run.id,
                    RunStatus.PAUSED,
                    expected=status,
                    message="paused (its worker was gone before it saw the request)",
                )
                result.paused.append(run.id)
                continue
            failures = run.failures + expired
            if failures >= max_attempts:
                await transition(
                    session,
                    run.id,
                    RunStatus.FAILED,
                    expected=status,
                    error=await gave_up(session, run.id, failures),
                    values={"failures": failures},
                )
                result.failed.append(run.id)
                continue
        except TransitionConflict:
            continue
        if expired:
            await events.append(
                session,
                run.id,
                "lease",
                f"lease of {run.lease_owner} expired; re-queued",
                level="warning",
                data={"owner": run.lease_owner, "attempt": run.attempt},
            )
        await session.execute(
            update(Run)
            .where(col(Run.id) == run.id)
            .values(
                dispatched_at=None,  # due until stamp_dispatched says its task is out
                lease_owner=None,
                lease_expires_at=None,
                # Its holder died or lost touch: that attempt failed.
                failures=Run.failures + (1 if expired else 0),
            )
        )
        result.dispatch.append(run.id)
    return result


async def stamp_dispatched(session: AsyncSession, run_ids: list[uuid.UUID]) -> None:
    """The runs' tasks are published: not due again for ``redispatch_seconds``."""
    if run_ids:
        await session.execute(
            update(Run).where(col(Run.id).in_(run_ids)).values(dispatched_at=func.now())
        )
