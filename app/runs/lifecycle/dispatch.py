"""Getting due runs to a worker, strictly after the commit that made them due.

The outbox is the ``runs`` table itself: a run is due for dispatch while it is live, unheld
and ``dispatched_at`` is NULL (or old). Whoever makes a run due also calls :func:`mark_due`,
a ``pg_notify`` that Postgres delivers only if and when the transaction commits; the
workers' reconciler listens, publishes the Celery task and stamps ``dispatched_at`` (in
that order, in one transaction: app/runs/lifecycle/reconcile.py). A lost notification
costs latency, never the run: the reconciler also sweeps on a timer.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

log = logging.getLogger(__name__)

ADVANCE_TASK = "runs.advance"
DUE_CHANNEL = "trainyard_runs_due"


async def mark_due(session: AsyncSession, run_id: uuid.UUID) -> None:
    """Wake the reconciler once this transaction commits (nothing happens on rollback)."""
    await session.execute(select(func.pg_notify(DUE_CHANNEL, str(run_id))))


class Dispatcher:
    """Publishes ``runs.advance`` for run ids, up to the first that fails (the broker is
    down: the rest would fail too). What it did not publish the reconciler leaves unstamped,
    due again at its next sweep."""

    def __init__(self, celery: Any) -> None:
        self._celery = celery

    def publish(self, run_ids: Iterable[uuid.UUID]) -> list[uuid.UUID]:
        """The ids published, in order."""
        sent: list[uuid.UUID] = []
        for run_id in run_ids:
            try:
                self._celery.send_task(ADVANCE_TASK, args=[str(run_id)])
            except Exception as exc:  # broker down: the next sweep catches up
                log.warning("could not publish run %s (%s); will retry", run_id, exc)
                break
            sent.append(run_id)
        return sent
