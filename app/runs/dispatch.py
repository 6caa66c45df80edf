"""Publishing "this run is due" to the broker, after the commit that made it due."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

ADVANCE_TASK = "runs.advance"


class Dispatcher:
    """Sends ``runs.advance`` for run ids. A failed publish is logged and left to the
    reconciler, which re-publishes every due run whose last dispatch is old."""

    def __init__(self, celery: Any) -> None:
        self._celery = celery

    def publish(self, run_ids: Iterable[uuid.UUID]) -> int:
        sent = 0
        for run_id in run_ids:
            try:
                self._celery.send_task(ADVANCE_TASK, args=[str(run_id)])
                sent += 1
            except Exception as exc:  # broker down: the reconciler catches up
                log.warning("could not publish run %s (%s); the reconciler will retry", run_id, exc)
                break
        return sent
