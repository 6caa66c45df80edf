"""Housekeeping every worker does on a timer: the reconciler and idempotency-key expiry.

It runs in a daemon thread of each worker process; concurrent sweeps in several workers
are safe (row locks with SKIP LOCKED, compare-and-set transitions).
"""

from __future__ import annotations

import logging
import threading

from app.core.idempotency import purge_expired
from app.runs.dispatch import Dispatcher
from app.runs.reconcile import sweep
from workers.celery_app import get_celery
from workers.runtime import Runtime

log = logging.getLogger(__name__)


def reconcile_once(runtime: Runtime) -> int:
    async def _sweep() -> list:  # type: ignore[type-arg]
        async with runtime.session() as session:
            result = await sweep(
                session,
                redispatch_after_seconds=runtime.settings.redispatch_seconds,
                max_attempts=runtime.settings.max_attempts,
            )
            await purge_expired(session)
        return result.dispatch

    due = runtime.run(_sweep())
    # Published only after the sweep committed.
    return Dispatcher(get_celery()).publish(due) if due else 0


class Maintenance:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="trainyard-maintenance", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        interval = self.runtime.settings.reaper_interval_seconds
        while not self._stop.wait(interval):
            try:
                published = reconcile_once(self.runtime)
                if published:
                    log.info("reconciler re-published %d run(s)", published)
            except Exception:
                log.exception("reconciler sweep failed")
