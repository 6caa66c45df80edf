"""Housekeeping every worker does: the reconciler sweep, idempotency-key expiry and a pass
over the webhook outbox (app/webhooks/delivery.py).

It runs in a daemon thread of each worker process. A sweep runs at start, whenever
Postgres notifies that a run became due or a webhook event was written (``pg_notify`` on
commit), and every
``reaper_interval_seconds`` in any case. Concurrent sweeps in several workers are safe
(row locks with SKIP LOCKED, compare-and-set transitions).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from sqlalchemy.ext.asyncio import AsyncConnection

from app.core.errors import database_unavailable
from app.core.idempotency import purge_expired
from app.observability import prometheus
from app.runs.lifecycle.dispatch import DUE_CHANNEL, Dispatcher
from app.runs.lifecycle.reconcile import stamp_dispatched, sweep
from app.webhooks.delivery import CHANNEL as WEBHOOKS_CHANNEL
from app.webhooks.delivery import deliver_due
from workers.celery_app import QUEUES, get_celery
from workers.runtime import Runtime

log = logging.getLogger(__name__)


def reconcile_once(runtime: Runtime, dispatcher: Dispatcher) -> int:
    """One pass in one transaction: the sweep, the due runs published (their rows still
    locked), those the broker took stamped, the commit (app/runs/lifecycle/reconcile.py).
    Returns how many were published."""

    async def _pass() -> int:
        async with runtime.session() as session:
            result = await sweep(
                session,
                redispatch_after_seconds=runtime.settings.redispatch_seconds,
                max_attempts=runtime.settings.max_attempts,
            )
            await purge_expired(session)
            due = result.dispatch
            sent = await asyncio.to_thread(dispatcher.publish, due) if due else []
            await stamp_dispatched(session, sent)
        return len(sent)

    return runtime.run(_pass())


def _failed(what: str, exc: Exception) -> None:
    """A pass that failed: one line while the database is unreachable (every pass retries
    it), the whole traceback for anything else."""
    if database_unavailable(exc):
        log.warning("%s: database unreachable (%s)", what, exc)
    else:
        log.error(what, exc_info=exc)


class Maintenance:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._dispatcher = Dispatcher(get_celery())
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._listener: AsyncConnection | None = None
        self._thread = threading.Thread(
            target=self._loop, name="trainyard-maintenance", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30) -> None:
        """No new pass; the pass under way finishes (this thread is a daemon), so a run
        this worker just handed over is published before the process exits, not left to
        another worker's next sweep."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

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
        for channel in (DUE_CHANNEL, WEBHOOKS_CHANNEL):
            await raw.driver_connection.add_listener(  # type: ignore[union-attr]
                channel, lambda *_: self._wake.set()
            )
        self._listener = conn

    def _loop(self) -> None:
        interval = self.runtime.settings.reaper_interval_seconds
        while not self._stop.is_set():
            try:
                self.runtime.run(self._ensure_listening(), timeout=30)
            except Exception as exc:
                _failed("cannot LISTEN for due runs; sweeping on the timer only", exc)
            self._wake.clear()
            try:
                published = reconcile_once(self.runtime, self._dispatcher)
                if published:
                    log.info("published %d due run(s)", published)
            except Exception as exc:
                _failed("reconciler sweep failed", exc)
            if self._stop.is_set():
                break
            try:
                # The webhook outbox: events committed since the last pass, and retries due.
                self.runtime.run(deliver_due(self.runtime.sessionmaker, self.runtime.settings))
            except Exception as exc:
                _failed("webhook delivery pass failed", exc)
            if self._exporting_metrics:
                try:
                    self.runtime.run(self._refresh_run_gauges(), timeout=30)
                    prometheus.refresh_queue_depth(get_celery(), QUEUES)
                except Exception as exc:
                    _failed("metrics refresh failed", exc)
            self._wake.wait(interval)

    @property
    def _exporting_metrics(self) -> bool:
        """Runs by status and queue depth cost a GROUP BY over every run and a broker
        round trip: only refreshed where something reads them."""
        return bool(self.runtime.settings.worker_metrics_port or prometheus.multiprocess_dir())

    async def _refresh_run_gauges(self) -> None:
        async with self.runtime.session() as session:
            await prometheus.refresh_run_gauges(session)
