"""PostgreSQL fails: restarted mid-run (a fast shutdown, then a start), and gone for longer
than twice the lease TTL. A server of the test's own (tests/support/postgres.py) serves the
API, the workers and the test; every run still completes, each rollout stored once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.support import postgres
from tests.support.postgres import OwnPostgres
from tests.support.runs import run_body, trajectory_keys, wait_for

pytestmark = pytest.mark.chaos

# Everything on the test's own server: the API, the sessions, the workers.
own_postgres = postgres.own_postgres
own_database = postgres.own_database

STEPS = 4
TTL = 1.5  # tests/support/workers.py FAST


def _body() -> dict[str, Any]:
    return run_body(max_steps=STEPS, rollouts_per_group=2, config={"tick": 0.4})


def _rows() -> list[tuple[int, int, int]]:
    return [(s, g, r) for s in range(STEPS) for g in range(2) for r in range(2)]


async def _all_complete_once(maker: Any, runs: list[str], within: float = 120) -> None:
    for run_id in runs:
        done = await wait_for(maker, run_id, lambda r: r.status in {"completed", "failed"}, within)
        assert done.status == "completed", done.error
        assert await trajectory_keys(maker, run_id) == _rows()


async def test_postgres_restarted_mid_run_loses_nothing(
    client: Any, tenant: Any, sessionmaker: Any, start_worker: Any, own_postgres: OwnPostgres
) -> None:
    start_worker()
    start_worker()
    runs = [
        (await client.post("/runs", json=_body(), headers=tenant.headers)).json()["id"]
        for _ in range(3)
    ]
    for run_id in runs[:2]:
        await wait_for(sessionmaker, run_id, lambda r: r.step >= 1, within=60)
    await own_postgres.stop()
    await own_postgres.start()
    await _all_complete_once(sessionmaker, runs)


async def test_postgres_gone_past_the_lease_ttl(
    client: Any,
    tenant: Any,
    sessionmaker: Any,
    start_worker: Any,
    own_postgres: OwnPostgres,
) -> None:
    """Gone for 3 × the lease TTL: the workers stop (their leases cannot be renewed), the API
    answers 503 problem+json with Retry-After and /readyz says the database is down; once it
    is back, the runs resume and complete."""
    workers = [start_worker(), start_worker()]
    runs = [
        (await client.post("/runs", json=_body(), headers=tenant.headers)).json()["id"]
        for _ in range(2)
    ]
    for run_id in runs:
        await wait_for(sessionmaker, run_id, lambda r: r.step >= 1, within=60)
    await own_postgres.stop()
    try:
        down = await client.get(f"/runs/{runs[0]}", headers=tenant.headers)
        assert down.status_code == 503, down.text
        assert down.headers["content-type"] == "application/problem+json"
        assert int(down.headers["Retry-After"]) >= 1
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["database"] != "ok"
        await asyncio.sleep(3 * TTL)  # the outage itself: nothing to wait on but time
        # Each run's worker stopped working on it: its next write (or its heartbeat, past
        # the lease's TTL) found the database gone.
        for run_id in runs:
            logs = "".join(worker.output() for worker in workers)
            assert (
                f"run {run_id}: database unreachable" in logs
                or f"run {run_id}: lease expired" in logs
            ), logs[-3000:]
    finally:
        await own_postgres.start()
    await _all_complete_once(sessionmaker, runs)
    assert (await client.get("/readyz")).status_code == 200
