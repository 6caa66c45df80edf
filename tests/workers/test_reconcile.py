"""A reconciler pass publishes the due runs before it stamps them, in one transaction
(app/runs/lifecycle/reconcile.py): a run the broker did not take is not stamped, so the
next pass publishes it, not one ``redispatch_seconds`` later. Real PostgreSQL, a real Redis
broker, and a broker address nothing listens on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from app.observability import prometheus
from app.runs.lifecycle.dispatch import Dispatcher
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from tests.support.database import Maker, OwnDatabase, new_tenant
from tests.support.runs import create_run

NOBODY = "redis://127.0.0.1:1/0"  # connection refused


async def test_a_run_the_broker_did_not_take_is_published_by_the_next_pass(
    own_database: OwnDatabase, sessionmaker: Maker
) -> None:
    from workers.celery_app import QUEUES, make_celery
    from workers.maintenance import reconcile_once
    from workers.runtime import Runtime

    tenant = await new_tenant(sessionmaker)
    new = await create_run(sessionmaker, project_id=tenant.project_id)
    # Its worker died a minute ago, just after the run was dispatched.
    orphan = await create_run(
        sessionmaker,
        project_id=tenant.project_id,
        status=RunStatus.COLLECTING,
        lease_owner="gone",
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=60),
        dispatched_at=datetime.now(UTC) - timedelta(seconds=90),
    )
    settings = own_database.settings.model_copy(update={"redispatch_seconds": 3600.0})
    runtime = Runtime(settings)
    broker = make_celery(own_database.broker_url, own_database.broker_prefix)
    try:
        assert reconcile_once(runtime, Dispatcher(make_celery(NOBODY))) == 0
        rows = {r.id: r for r in [await _row(sessionmaker, new), await _row(sessionmaker, orphan)]}
        assert all(r.dispatched_at is None for r in rows.values())  # due, not stamped
        assert rows[orphan.id].lease_owner is None and rows[orphan.id].failures == 1
        assert prometheus.refresh_queue_depth(broker, QUEUES)["gpu"] == 0

        assert reconcile_once(runtime, Dispatcher(broker)) == 2
        for run in (new, orphan):
            row = await _row(sessionmaker, run)
            assert row.dispatched_at is not None
            assert row.failures == (1 if run is orphan else 0)  # the dead lease counted once
        assert prometheus.refresh_queue_depth(broker, QUEUES)["gpu"] == 2
        # Stamped: not due again for redispatch_seconds.
        assert reconcile_once(runtime, Dispatcher(broker)) == 0
    finally:
        runtime.run(runtime.engine.dispose())


async def _row(maker: Maker, run: Run) -> Run:
    async with maker() as session:
        row = await session.get(Run, run.id, populate_existing=True)
    assert row is not None
    return row
