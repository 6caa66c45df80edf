"""Leases, heartbeats and the reconciler with real Celery workers, Redis and Postgres."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from app.events.models import RunEvent
from app.runs.models import Run
from app.trajectories.models import Trajectory
from tests.conftest import run_body


async def _run(maker: Any, run_id: str) -> Run:
    async with maker() as s:
        run = await s.get(Run, uuid.UUID(run_id))
        assert run is not None
        return run


async def wait_for(
    maker: Any,
    run_id: str,
    predicate: Callable[[Run], bool],
    within: float = 30,
    every: float = 0.1,
) -> Run:
    deadline = time.monotonic() + within
    while True:
        run = await _run(maker, run_id)
        if predicate(run):
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; run is {run.status} step {run.step}: {run.error}")
        await asyncio.sleep(every)


async def _events(maker: Any, run_id: str) -> list[RunEvent]:
    async with maker() as s:
        return list(
            (
                await s.execute(
                    select(RunEvent)
                    .where(RunEvent.run_id == uuid.UUID(run_id))
                    .order_by(RunEvent.id)
                )
            ).scalars()
        )


async def _trajectory_keys(maker: Any, run_id: str) -> list[tuple[int, int, int]]:
    async with maker() as s:
        rows = await s.execute(
            select(Trajectory.step, Trajectory.group_index, Trajectory.rollout_index).where(
                Trajectory.run_id == uuid.UUID(run_id)
            )
        )
        return sorted(tuple(r) for r in rows)


def _body(**config: Any) -> dict[str, Any]:
    return run_body(max_steps=3, rollouts_per_group=2, config={"tick": 0.15, **config})


async def test_created_run_is_claimed_and_walks_every_phase(
    client, tenant, sessionmaker, start_worker
) -> None:
    start_worker()
    run = (await client.post("/runs", json=_body(), headers=tenant.headers)).json()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed")
    assert done.attempt == 1 and done.lease_owner is None and done.step == 3
    statuses = [e.data["to"] for e in await _events(sessionmaker, run["id"]) if e.type == "status"]
    assert statuses == ["generating"] + ["collecting", "scoring", "training"] * 3 + ["completed"]
    expected = [(s, g, r) for s in range(3) for g in range(2) for r in range(2)]
    assert await _trajectory_keys(sessionmaker, run["id"]) == expected


async def test_killed_worker_is_replaced_and_nothing_is_lost_or_doubled(
    client, tenant, sessionmaker, start_worker
) -> None:
    first = start_worker()
    run = (await client.post("/runs", json=_body(tick=0.3), headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == "training" and r.step >= 1)
    first.kill()  # SIGKILL mid-step: its task is never acknowledged nor finished
    killed_at = time.monotonic()
    start_worker()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed", within=45)
    # Reclaimed within lease TTL + reaper interval (+ worker start and a tick of slack).
    assert done.attempt == 2
    assert time.monotonic() - killed_at < 30
    expected = [(s, g, r) for s in range(3) for g in range(2) for r in range(2)]
    assert await _trajectory_keys(sessionmaker, run["id"]) == expected
    kinds = [e.type for e in await _events(sessionmaker, run["id"])]
    assert "lease" in kinds
    assert any("expired" in e.message for e in await _events(sessionmaker, run["id"]))


async def test_poison_run_fails_after_the_attempt_cap(
    client, tenant, sessionmaker, start_worker
) -> None:
    start_worker(pool="prefork")  # the parent replaces each child the run kills
    run = (
        await client.post("/runs", json=_body(die_in_training=True), headers=tenant.headers)
    ).json()
    failed = await wait_for(sessionmaker, run["id"], lambda r: r.status == "failed", within=60)
    assert failed.attempt == 3
    assert "3 attempts" in (failed.error or "")
    assert any(
        e.type == "status" and e.level == "error" for e in await _events(sessionmaker, run["id"])
    )


async def test_cancel_mid_run_stops_within_a_heartbeat(
    client, tenant, sessionmaker, start_worker
) -> None:
    start_worker()
    run = (await client.post("/runs", json=_body(tick=1.0), headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == "collecting")
    r = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["cancel_requested"] is True
    asked = time.monotonic()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "cancelled", within=10)
    # heartbeat 0.25 s: the worker sees the flag and stops mid-tick, well before the 1 s tick.
    assert time.monotonic() - asked < 1.0
    assert done.lease_owner is None
    r = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"


async def test_pause_at_a_step_boundary_then_resume_completes(
    client, tenant, sessionmaker, start_worker
) -> None:
    start_worker()
    run = (await client.post("/runs", json=_body(tick=0.2), headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == "collecting")
    r = await client.post(f"/runs/{run['id']}/pause", headers=tenant.headers)
    assert r.json()["pause_requested"] is True
    paused = await wait_for(sessionmaker, run["id"], lambda r: r.status == "paused")
    assert paused.step == 1 and paused.lease_owner is None
    r = await client.post(f"/runs/{run['id']}/resume", headers=tenant.headers)
    assert r.json()["status"] == "pending"
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed")
    assert done.step == 3 and done.attempt == 2
    expected = [(s, g, r) for s in range(3) for g in range(2) for r in range(2)]
    assert await _trajectory_keys(sessionmaker, run["id"]) == expected


async def test_duplicate_delivery_is_refused_by_the_lease(
    client, tenant, sessionmaker, start_worker, service_urls
) -> None:
    from app.core.settings import get_settings
    from app.runs.dispatch import Dispatcher
    from workers.celery_app import make_celery

    start_worker()
    start_worker()
    run = (await client.post("/runs", json=_body(tick=0.3), headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == "collecting")
    # Deliver the same task twice more while the first worker holds the run.
    celery = make_celery(service_urls[1], get_settings().broker_prefix)
    assert Dispatcher(celery).publish([uuid.UUID(run["id"])] * 2) == 2
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed")
    assert done.attempt == 1
    claims = [e for e in await _events(sessionmaker, run["id"]) if e.type == "lease"]
    assert len(claims) == 1


async def test_run_created_while_no_worker_listens_still_starts(
    client, tenant, sessionmaker, start_worker
) -> None:
    """Its notification reached nobody and nothing was published: the first sweep of the
    worker that comes up later dispatches it (the crash-between-commit-and-publish case)."""
    run = (await client.post("/runs", json=_body(), headers=tenant.headers)).json()
    await asyncio.sleep(0.5)
    assert (await _run(sessionmaker, run["id"])).dispatched_at is None
    start_worker(TRAINYARD_REAPER_INTERVAL_SECONDS="60")
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed")
    assert done.attempt == 1


async def test_commit_notification_wakes_the_reconciler(
    client, tenant, sessionmaker, start_worker
) -> None:
    """With the timer at 60 s, only the pg_notify sent on commit can start the run quickly."""
    start_worker(TRAINYARD_REAPER_INTERVAL_SECONDS="60")
    await asyncio.sleep(0.5)  # past the worker's start-up sweep
    created = time.monotonic()
    run = (await client.post("/runs", json=_body(), headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.attempt == 1, within=10)
    assert time.monotonic() - created < 5
