"""The Celery app. Redis is only the broker: losing it loses nothing, since Postgres knows
which runs are due and the reconciler re-publishes them.

Queues: ``control`` (CPU work: input generation, judges, the reconciler) and ``gpu``
(rollouts and training). Tasks take ids and re-read state from the database.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from functools import lru_cache
from typing import Any

from celery import Celery, signals
from kombu import Queue

from app.core.logs import configure_logging, log_context
from app.core.services import redis_url
from app.core.settings import get_settings

QUEUES = ("control", "gpu")

TASK_ROUTES = {
    "runs.advance": {"queue": "gpu"},
    "runs.reconcile": {"queue": "control"},
}


def make_celery(broker_url: str, prefix: str = "", visibility_timeout: float = 3600.0) -> Celery:
    app = Celery("trainyard", broker=broker_url, include=["workers.tasks"])
    app.conf.update(
        task_queues=[Queue(name) for name in QUEUES],
        task_default_queue="control",
        task_routes=TASK_ROUTES,
        # At-least-once: a task is acknowledged only after it ran, and given back if the
        # worker process dies. Duplicates are refused by the run's lease.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        # Redelivery of an unacknowledged task: far longer than a heartbeat period, so only
        # a lost worker's task comes back, and then the lease decides.
        broker_transport_options={
            "visibility_timeout": visibility_timeout,
            # How often a worker looks for tasks past their visibility timeout: every scan
            # (not every tenth), at most every 10 s, and twice per timeout when it is short.
            "unacked_restore_interval": min(10.0, max(0.5, visibility_timeout / 2)),
            "unacked_restore_throttle": 1,
            "socket_connect_timeout": 2,
            "socket_timeout": 5,
            **({"global_keyprefix": prefix} if prefix else {}),
        },
        # Publishing must fail fast when Redis is down: the reconciler will publish later.
        task_publish_retry=True,
        task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.5},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        enable_utc=True,
    )
    return app


@lru_cache
def get_celery() -> Celery:
    settings = get_settings()
    return make_celery(
        redis_url(settings), settings.broker_prefix, settings.broker_visibility_timeout_seconds
    )


@signals.setup_logging.connect
def _configure_logging(loglevel: int | str | None = None, **_: Any) -> None:
    """The worker logs as the API does. A receiver of this signal tells Celery to configure
    no logging of its own, so its loggers (``celery.*``, the task loggers) reach the one
    handler :func:`configure_logging` puts on the root, and none twice."""
    configure_logging(loglevel or "INFO")


# Each running task's log scope, by task id: the lines it logs carry its task id (the
# driver adds the run id); the scope's context reaches the runtime loop with the coroutine.
_task_scopes: dict[str, AbstractContextManager[Any]] = {}


@signals.task_prerun.connect
def _enter_task_scope(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        scope = log_context(task_id=task_id)
        scope.__enter__()
        _task_scopes[task_id] = scope


@signals.task_postrun.connect
def _leave_task_scope(task_id: str | None = None, **_: Any) -> None:
    scope = _task_scopes.pop(task_id, None) if task_id is not None else None
    if scope is not None:
        scope.__exit__(None, None, None)
