"""Housekeeping every worker does: the reconciler sweep and idempotency-key expiry.

It runs in a daemon thread of each worker process. A sweep runs at start, whenever
Postgres notifies that a run became due (``pg_notify`` on commit), and every
``reaper_interval_seconds`` in any case. Concurrent sweeps in several workers are safe
(row locks with SKIP LOCKED, compare-and-set transitions).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from app.core.idempotency import purge_expired
from app.runs.dispatch import DUE_CHANNEL, Dispatcher
from app.runs.reconcile import sweep
from workers.celery_app import get_celery
from workers.runtime import Runtime

log = logging.getLogger(__name__)


def reconcile_once(runtime: Runtime) -> int:
    """One sweep, committed, then the due runs published. Returns how many were sent."""

    async def _sweep() -> list[Any]:
        async with runtime.session() as session:
            result = await sweep(
                session,
                redispatch_after_seconds=runtime.settings.redispatch_seconds,
                max_attempts=runtime.settings.max_attempts,
            )
            await purge_expired(session)
        return result.dispatch

    due = runtime.run(_sweep())
    return Dispatcher(get_celery()).publish(due) if due else 0


class Maintenance:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._listener: AsyncConnection | None = None
        self._thread = threading.Thread(
            target=self._loop, name="trainyard-maintenance", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    async def _ensure_listening(self) -> None:
        """LISTEN on a dedicated idle connection; re-established if it was lost."""
        if self._listener is not None:
            raw = await self._listener.get_raw_connection()
            if not raw.driver_connection.is_closed():  # type: ignore[union-attr]
                return
            await self._listener.invalidate()
            self._listener = None
        conn = await self.runtime.engine.connect()
        raw = await conn.get_raw_connection()
        await raw.driver_connection.add_listener(  # type: ignore[union-attr]
            DUE_CHANNEL, lambda *_: self._wake.set()
        )
        self._listener = conn

    def _loop(self) -> None:
        interval = self.runtime.settings.reaper_interval_seconds
        while not self._stop.is_set():
            try:
                self.runtime.run(self._ensure_listening(), timeout=30)
            except Exception:
                log.exception("cannot LISTEN for due runs; sweeping on the timer only")
            self._wake.clear()
            try:
                published = reconcile_once(self.runtime)
                if published:
                    log.info("published %d due run(s)", published)
            except Exception:
                log.exception("reconciler sweep failed")
            self._wake.wait(interval)
