"""The workers' maintenance loop sends the outbox, woken by the triggers' notification.

A real :class:`workers.maintenance.Maintenance` runs on a database of the test's own, with
a timer far longer than the test: once a first event has been delivered (the loop's pass
is then over), a second one can only arrive through the ``pg_notify`` its commit sends.
"""

from __future__ import annotations

import asyncio
import threading

from app.runs.lifecycle.state import transition
from app.runs.lifecycle.status import RunStatus
from app.webhooks import service
from app.webhooks.schemas import WebhookCreate
from tests.support.database import OwnDatabase, new_tenant, own_database, sessions_on
from tests.support.runs import create_run
from tests.webhooks.receiver import Receiver

__all__ = ["own_database"]  # the fixture, imported for this module's tests

WAIT_SECONDS = 15.0


async def test_the_maintenance_loop_delivers_after_commit(
    own_database: OwnDatabase, receiver: Receiver
) -> None:
    from workers.maintenance import Maintenance
    from workers.runtime import Runtime

    settings = own_database.settings.model_copy(
        update={"webhooks_allow_private": True, "reaper_interval_seconds": 600.0}
    )
    arrived = threading.Semaphore(0)
    original = receiver._handle

    def handle(handler):  # type: ignore[no-untyped-def]
        answer = original(handler)
        arrived.release()
        return answer

    receiver._handle = handle  # type: ignore[method-assign]
    receiver.start()
    async with sessions_on(own_database.url, pool_size=2) as maker:
        tenant = await new_tenant(maker)
        async with maker() as s:
            body = WebhookCreate(url=receiver.url("/loop"), event_types=["run.cancelled"])
            webhook = await service.create(s, tenant.project_id, body, allow_private=True)
            await s.commit()
        receiver.secrets["/loop"] = webhook.secret
        # Paused runs: nothing the reconciler would dispatch meanwhile.
        runs = [
            await create_run(maker, project_id=tenant.project_id, status=RunStatus.PAUSED)
            for _ in range(2)
        ]

        runtime = Runtime(settings)
        maintenance = Maintenance(runtime)
        maintenance.start()
        try:
            for n, run in enumerate(runs, 1):
                async with maker() as s:
                    await transition(s, run.id, RunStatus.CANCELLED)
                    await s.commit()
                got = await asyncio.to_thread(arrived.acquire, timeout=WAIT_SECONDS)
                assert got, f"event {n} was not delivered"
        finally:
            maintenance.stop(WAIT_SECONDS)  # the pass under way ends before stop returns
            assert not maintenance._thread.is_alive()
            if maintenance._listener is not None:
                runtime.run(maintenance._listener.close())
            runtime.run(runtime.engine.dispose())
    assert [(r.verified, r.answered) for r in receiver.received] == [(True, 204), (True, 204)]
    assert {r.body["data"]["run_id"] for r in receiver.received if r.body} == {
        str(run.id) for run in runs
    }
