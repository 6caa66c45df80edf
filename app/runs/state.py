"""The run state machine: the only place a run's status changes.

``TRANSITIONS`` is the whole table; :func:`transition` is the only writer of ``runs.status``.
It is a compare-and-set on (status, version) — and, for workers, on the lease and its
fencing token — that bumps ``version`` and appends a run event in the same transaction. A
caller that loses the race gets :class:`TransitionConflict` (HTTP 409) and nothing changes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.core.errors import Problem
from app.events.models import RunEvent
from app.runs.models import Run
from app.runs.status import TERMINAL, RunStatus

S = RunStatus

#: Allowed moves. Each line says why the move exists.
TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    # A worker picks the run up: it makes inputs first, or — for a run resumed after a
    # pause at a step boundary whose inputs already exist — goes straight to collecting.
    S.PENDING: frozenset({S.GENERATING, S.COLLECTING, S.PAUSED, S.FAILED, S.CANCELLED}),
    # Inputs are persisted; the first step starts.
    S.GENERATING: frozenset({S.COLLECTING, S.PAUSED, S.FAILED, S.CANCELLED}),
    # Every rollout of the step is stored; the judges/reward functions take over.
    S.COLLECTING: frozenset({S.SCORING, S.PAUSED, S.FAILED, S.CANCELLED}),
    # Every trajectory has its reward; the policy update starts. Back to collecting when a
    # step is redone from the start after its worker died mid-scoring.
    S.SCORING: frozenset({S.TRAINING, S.COLLECTING, S.PAUSED, S.FAILED, S.CANCELLED}),
    # A step ends: either the next one collects, or the plan is exhausted.
    S.TRAINING: frozenset({S.COLLECTING, S.COMPLETED, S.PAUSED, S.FAILED, S.CANCELLED}),
    # Resume puts the run back in the queue; a paused run can still be given up.
    S.PAUSED: frozenset({S.PENDING, S.FAILED, S.CANCELLED}),
    # Terminal: a finished, failed or cancelled run never changes again.
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}


def can_transition(src: RunStatus, dst: RunStatus) -> bool:
    return dst in TRANSITIONS[src]


@dataclass(frozen=True)
class Fence:
    """A worker's claim on a run: its writes count only while it still holds the lease."""

    owner: str
    attempt: int


class TransitionConflict(Problem):
    def __init__(
        self,
        run_id: uuid.UUID,
        detail: str,
        *,
        current: RunStatus | None,
        retryable: bool = False,
    ) -> None:
        super().__init__(
            409,
            "Run state conflict",
            detail,
            type_="https://trainyard.dev/problems/run-state-conflict",
            run_id=str(run_id),
            current_status=current.value if current else None,
        )
        self.current = current
        # True when the caller merely lost a race and may re-read and try again.
        self.retryable = retryable


class InvalidTransition(TransitionConflict):
    def __init__(self, run_id: uuid.UUID, src: RunStatus, dst: RunStatus) -> None:
        super().__init__(run_id, f"A {src.value} run cannot become {dst.value}.", current=src)


class LeaseLost(TransitionConflict):
    """The worker's lease expired or was taken over: it must stop touching the run."""

    def __init__(self, run_id: uuid.UUID) -> None:
        super().__init__(run_id, "This worker no longer holds the run's lease.", current=None)


async def transition(
    session: AsyncSession,
    run_id: uuid.UUID,
    dst: RunStatus,
    *,
    expected: RunStatus | frozenset[RunStatus] | None = None,
    fence: Fence | None = None,
    message: str | None = None,
    error: str | None = None,
    data: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
) -> Run:
    """Move ``run_id`` to ``dst`` atomically, or raise and change nothing.

    ``expected`` narrows the statuses the caller believes the run is in; ``fence`` makes the
    write count only for the worker holding the lease. ``values`` are extra columns set in
    the same UPDATE (step, metrics …). Returns the updated run.
    """
    row = (
        await session.execute(
            select(col(Run.status), col(Run.version), col(Run.lease_owner), col(Run.attempt))
            .where(col(Run.id) == run_id)
            # Locked until commit: a flag set by the API meanwhile (a cancel or pause
            # request) waits instead of making a worker's legitimate move fail.
            .with_for_update()
        )
    ).first()
    if row is None:
        raise Problem(404, "Not Found", "Run not found.")
    src = RunStatus(row.status)
    allowed = {expected} if isinstance(expected, RunStatus) else expected
    if allowed is not None and src not in allowed:
        raise TransitionConflict(
            run_id, f"Run is {src.value}, not {', '.join(sorted(allowed))}.", current=src
        )
    if fence is not None and (row.lease_owner, row.attempt) != (fence.owner, fence.attempt):
        raise LeaseLost(run_id)
    if not can_transition(src, dst):
        raise InvalidTransition(run_id, src, dst)

    now = func.now()
    changes: dict[str, Any] = {
        "status": dst.value,
        "version": Run.version + 1,
        "updated_at": now,
        **(values or {}),
    }
    if src == S.PENDING and dst != S.PAUSED and dst not in TERMINAL:
        changes.setdefault("started_at", func.coalesce(Run.started_at, now))
    if dst in TERMINAL:
        changes["completed_at"] = now
        changes["lease_owner"] = None
        changes["lease_expires_at"] = None
        changes["pause_requested"] = False
    if dst == S.PAUSED:
        changes["pause_requested"] = False
        changes["lease_owner"] = None
        changes["lease_expires_at"] = None
    if error is not None:
        changes["error"] = error

    stmt = update(Run).where(
        col(Run.id) == run_id, col(Run.status) == src.value, col(Run.version) == row.version
    )
    if fence is not None:
        stmt = stmt.where(col(Run.lease_owner) == fence.owner, col(Run.attempt) == fence.attempt)
    stmt = stmt.values(**changes).execution_options(
        synchronize_session=False, populate_existing=True
    )
    updated = (await session.execute(stmt.returning(Run))).scalar_one_or_none()
    if updated is None:
        current = await session.scalar(select(col(Run.status)).where(col(Run.id) == run_id))
        raise TransitionConflict(
            run_id,
            "The run changed while this request was being handled; fetch it and retry.",
            current=RunStatus(current) if current else None,
            retryable=True,
        )

    level = "error" if dst == S.FAILED else "info"
    await session.execute(
        insert(RunEvent).values(
            run_id=run_id,
            type="status",
            level=level,
            message=message or f"{src.value} → {dst.value}",
            data={
                "from": src.value,
                "to": dst.value,
                **({"error": error} if error else {}),
                **(data or {}),
            },
        )
    )
    return updated
