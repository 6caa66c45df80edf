"""Celery tasks. Thin: they take ids, re-read state from Postgres and call the services."""

from __future__ import annotations

import logging
import sys
import uuid

from celery.signals import (
    worker_process_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from app.observability import prometheus
from workers.celery_app import get_celery
from workers.context import SHUTTING_DOWN
from workers.driver import drive, load_pipeline
from workers.maintenance import Maintenance, reconcile_once
from workers.runtime import get_runtime

log = logging.getLogger(__name__)
celery = get_celery()
_maintenance: Maintenance | None = None


@celery.task(name="runs.advance")
def advance(run_id: str) -> str:
    """Drive the run as far as it goes. A duplicate delivery finds the run leased and
    returns at once; a run whose worker died is picked up here again by the reconciler."""
    runtime = get_runtime()
    pipeline = load_pipeline(runtime.settings.pipeline)
    outcome = runtime.run(drive(runtime, uuid.UUID(run_id), pipeline))
    log.info("run %s: %s", run_id, outcome)
    return outcome


@celery.task(name="runs.reconcile")
def reconcile() -> int:
    """Re-publish due runs now (the workers also do this every reaper interval)."""
    return reconcile_once(get_runtime())


@worker_ready.connect
def _start_maintenance(**_: object) -> None:
    global _maintenance
    runtime = get_runtime()
    settings = runtime.settings
    policy = runtime.policy
    (log.warning if policy.refuses_every_run else log.info)("%s", policy.summary())
    prometheus.start_worker_metrics(
        settings.worker_metrics_port, settings.metrics_token, settings.metrics_host
    )
    _maintenance = Maintenance(runtime)
    _maintenance.start()


@worker_shutting_down.connect
def _hand_over_runs(how: str = "Warm", **_: object) -> None:
    """A warm shutdown (SIGTERM, a deploy): the run this process drives stops at its next
    step boundary, after its checkpoint, and goes to another worker at once, using no
    attempt. Celery waits for the task to return before it exits. A cold shutdown
    (a second signal, SIGQUIT) does not wait: the lease runs out, as for a crash."""
    log.info("%s shutdown: handing running runs over at their next step boundary", how)
    SHUTTING_DOWN.set()


@worker_shutdown.connect
def _stop_maintenance(**_: object) -> None:
    if _maintenance is not None:
        _maintenance.stop()


@worker_shutdown.connect
def _leave_ray(**_: object) -> None:
    """A worker that placed ranks on a Ray cluster leaves it as a driver before it exits:
    left connected, Ray's core worker aborts the process at the interpreter's exit."""
    if "ray" in sys.modules:
        from workers.pipeline.ray_ranks import disconnect

        disconnect()


@worker_process_init.connect
def _fresh_runtime_after_fork(**_: object) -> None:
    """A prefork child must not reuse the parent's event-loop thread or connections."""
    get_runtime.cache_clear()
