"""Leases, heartbeats and the reconciler with real Celery workers, Redis and Postgres."""

from __future__ import annotations

import uuid
from typing import Any

from tests.support.runs import events, get_run, run_body, status_walk, trajectory_keys, wait_for


def _body(**config: Any) -> dict[str, Any]:
    return run_body(max_steps=3, rollouts_per_group=2, config={"tick": 0.15, **config})


async def test_created_run_is_claimed_and_walks_every_phase(
    client, tenant, sessionmaker, start_worker
) -> None:
    start_worker()
    run = (await client.post("/runs", json=_body(), headers=tenant.headers)).json()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed")
    assert done.attempt == 1 and done.lease_owner is None and done.step == 3
    walk = ["generating"] + ["collecting", "scoring", "training"] * 3 + ["completed"]
    assert await status_walk(sessionmaker, run["id"]) == walk
    expected = [(s, g, r) for s in range(3) for g in range(2) for r in range(2)]
    assert await trajectory_keys(sessionmaker, run["id"]) == expected


async def test_killed_worker_is_replaced_and_nothing_is_lost_or_doubled(
    client, tenant, sessionmaker, start_worker
) -> None:
    first = start_worker()
    run = (await client.post("/runs", json=_body(tick=0.3), headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == "training" and r.step >= 1)
    first.kill()  # SIGKILL mid-step: its task is never acknowledged nor finished
    start_worker()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed", within=45)
    assert done.attempt == 2
    expected = [(s, g, r) for s in range(3) for g in range(2) for r in range(2)]
    assert await trajectory_keys(sessionmaker, run["id"]) == expected
    # Reclaimed because its lease ran out (the reaper's event), not by any other path.
    kinds = [e.type for e in await events(sessionmaker, run["id"])]
    assert "lease" in kinds
    assert any("expired" in e.message for e in await events(sessionmaker, run["id"]))


async def test_poison_run_fails_after_the_attempt_cap(
    client, tenant, sessionmaker, start_worker
) -> None:
    start_worker(pool="prefork")  # the parent replaces each child the run kills
    run = (
        await client.post("/runs", json=_body(die_in_training=True), headers=tenant.headers)
    ).json()
    failed = await wait_for(sessionmaker, run["id"], lambda r: r.status == "failed", within=60)
    assert failed.attempt == 3 and failed.failures == 3
    assert "3 failed attempts" in (failed.error or "")
    assert any(
        e.type == "status" and e.level == "error" for e in await events(sessionmaker, run["id"])
    )


async def test_cancel_mid_run_stops_within_a_heartbeat(
    client, tenant, sessionmaker, start_worker
) -> None:
    start_worker()
    body = _body(stall_in="collecting")  # collecting lasts an hour unless a stop wakes it
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == "collecting")
    r = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["cancel_requested"] is True
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "cancelled")
    # Only the heartbeat, which delivers the flag, could end the stalled phase: the worker
    # stopped mid-phase and the step it was collecting never stored its rollouts.
    assert done.lease_owner is None and done.step == 0
    assert await status_walk(sessionmaker, run["id"]) == ["generating", "collecting", "cancelled"]
    assert await trajectory_keys(sessionmaker, run["id"]) == []
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
    assert await trajectory_keys(sessionmaker, run["id"]) == expected


async def test_pauses_and_resumes_never_use_up_attempts(
    client, tenant, sessionmaker, start_worker
) -> None:
    """The attempt cap (3 here) counts failures: four pauses and resumes are no failure."""
    start_worker()
    body = run_body(max_steps=6, rollouts_per_group=2, config={"tick": 0.1})
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    for claim in range(1, 5):
        await wait_for(
            sessionmaker,
            run["id"],
            lambda r, n=claim: r.status == "collecting" and r.attempt == n,  # type: ignore[misc]
        )
        r = await client.post(f"/runs/{run['id']}/pause", headers=tenant.headers)
        assert r.status_code == 200, r.text
        await wait_for(sessionmaker, run["id"], lambda r: r.status == "paused")
        r = await client.post(f"/runs/{run['id']}/resume", headers=tenant.headers)
        assert r.status_code == 200 and r.json()["status"] == "pending", r.text
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed", within=60)
    assert done.attempt == 5 and done.failures == 0 and done.error is None
    served = (await client.get(f"/runs/{run['id']}", headers=tenant.headers)).json()
    assert (served["attempt"], served["failures"]) == (5, 0)
    expected = [(s, g, r) for s in range(6) for g in range(2) for r in range(2)]
    assert await trajectory_keys(sessionmaker, run["id"]) == expected


async def test_cancel_and_pause_of_a_fast_run_always_succeed(
    client, tenant, sessionmaker, start_worker
) -> None:
    """A worker moving a run as fast as it can (no tick) never makes a stop request lose."""
    start_worker()
    body = run_body(max_steps=10_000, rollouts_per_group=2, config={"tick": 0.0})
    for action, final in (("pause", "paused"), ("cancel", "cancelled")) * 3:
        run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
        await wait_for(sessionmaker, run["id"], lambda r: r.step >= 2, within=60)
        r = await client.post(f"/runs/{run['id']}/{action}", headers=tenant.headers)
        assert r.status_code == 200, r.text
        await wait_for(sessionmaker, run["id"], lambda r, f=final: r.status == f)  # type: ignore[misc]
        if final == "paused":
            r = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
            assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text


async def test_duplicate_delivery_is_refused_by_the_lease(
    client, tenant, sessionmaker, start_worker, own_database
) -> None:
    from app.runs.lifecycle.dispatch import Dispatcher
    from workers.celery_app import make_celery

    start_worker()
    start_worker()
    run = (await client.post("/runs", json=_body(tick=0.3), headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == "collecting")
    # Deliver the same task twice more while the first worker holds the run.
    celery = make_celery(own_database.broker_url, own_database.broker_prefix)
    assert len(Dispatcher(celery).publish([uuid.UUID(run["id"])] * 2)) == 2
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed")
    assert done.attempt == 1
    claims = [e for e in await events(sessionmaker, run["id"]) if e.type == "lease"]
    assert len(claims) == 1


async def test_run_created_while_no_worker_listens_still_starts(
    client, tenant, sessionmaker, start_worker
) -> None:
    """Its notification reached nobody and nothing was published: the first sweep of the
    worker that comes up later dispatches it (the crash-between-commit-and-publish case)."""
    run = (await client.post("/runs", json=_body(), headers=tenant.headers)).json()
    assert (await get_run(sessionmaker, run["id"])).dispatched_at is None
    worker = start_worker(TRAINYARD_REAPER_INTERVAL_SECONDS="3600")
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed")
    assert done.attempt == 1
    await worker.wait_for_output("published 1 due run(s)")


async def test_commit_notification_wakes_the_reconciler(
    client, tenant, sessionmaker, start_worker
) -> None:
    """With the timer at an hour, only the pg_notify sent on commit can start a run created
    after the worker's start-up sweep."""
    first = (await client.post("/runs", json=_body(), headers=tenant.headers)).json()
    worker = start_worker(TRAINYARD_REAPER_INTERVAL_SECONDS="3600")
    # The start-up sweep published the first run: the worker listens and has swept once.
    await worker.wait_for_output("published 1 due run(s)")
    await wait_for(sessionmaker, first["id"], lambda r: r.status == "completed")
    run = (await client.post("/runs", json=_body(), headers=tenant.headers)).json()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed")
    assert done.attempt == 1
