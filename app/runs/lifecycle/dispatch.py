"""Getting due runs to a worker, strictly after the commit that made them due.

The outbox is the ``runs`` table itself: a run is due for dispatch while it is live, unheld
and ``dispatched_at`` is NULL (or old). Whoever makes a run due also calls :func:`mark_due`,
a ``pg_notify`` that Postgres delivers only if and when the transaction commits; the
workers' reconciler listens, publishes the Celery task and stamps ``dispatched_at`` (in
that order, in one transaction: app/runs/lifecycle/reconcile.py). A lost notification
costs latency, never the run: the reconciler also sweeps on a timer.

A run's creation is the exception: PostgreSQL holds one lock for the whole server from a
NOTIFYing transaction's pre-commit to the end of its commit (its WAL flush included), so
creates that NOTIFY commit one at a time. A create commits without it and rings the API
process's :class:`DueBell` instead, which sends the NOTIFY after the commit, at most one
in flight per process: creates made while one is in flight share the next (the reconciler
sweeps every due run whichever woke it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable
from typing import Any

import asyncpg
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

log = logging.getLogger(__name__)

ADVANCE_TASK = "runs.advance"
DUE_CHANNEL = "trainyard_runs_due"


async def mark_due(session: AsyncSession, run_id: uuid.UUID) -> None:
    """Wake the reconciler once this transaction commits (nothing happens on rollback)."""
    await session.execute(select(func.pg_notify(DUE_CHANNEL, str(run_id))))


class DueBell:
    """Wakes the workers' reconciler after runs committed due (see the module's docstring):
    :meth:`ring` returns at once; one NOTIFY is sent for every ring made while none was in
    flight, on the process's asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._rung = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._send(), name="due-bell")

    def ring(self) -> None:
        self._rung.set()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._rung.is_set():  # a ring not sent yet: the reconciler's timer would find it
            with contextlib.suppress(Exception):
                await self._pool.execute(_NOTIFY)

    async def _send(self) -> None:
        while True:
            await self._rung.wait()
            self._rung.clear()
            try:
                await self._pool.execute(_NOTIFY)
            except Exception as exc:  # the database is away: the reconciler's timer sweeps
                log.warning("could not wake the reconciler (%s); its timer will sweep", exc)
                await asyncio.sleep(1.0)


_NOTIFY = f"SELECT pg_notify('{DUE_CHANNEL}', '')"


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
