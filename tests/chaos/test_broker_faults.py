"""The broker fails: Redis down when a run is created, restarted and flushed mid-run. Postgres
is the outbox, so every run still starts and finishes, once."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest
import redis

from app.catalog.models import Catalog
from app.catalog.policy import CodePolicy
from app.core.pg import connect_kwargs, create_pool
from app.runs.lifecycle.dispatch import DUE_CHANNEL, DueBell
from app.runs.repository import ActiveRunLimit
from app.runs.service import create_run
from app.runs.spec.body import RunCreate
from tests.support.broker import OwnRedis
from tests.support.runs import get_run, run_body, trajectory_keys, wait_for

pytestmark = pytest.mark.chaos

STEPS = 4


def _body(**config: Any) -> dict[str, Any]:
    return run_body(max_steps=STEPS, rollouts_per_group=2, config={"tick": 0.4, **config})


def _rows() -> list[tuple[int, int, int]]:
    return [(s, g, r) for s in range(STEPS) for g in range(2) for r in range(2)]


async def _completes_once(maker: Any, run_id: str, within: float = 90) -> None:
    done = await wait_for(maker, run_id, lambda r: r.status in {"completed", "failed"}, within)
    assert done.status == "completed", done.error
    assert await trajectory_keys(maker, run_id) == _rows()


async def test_redis_restarted_and_flushed_mid_run_loses_nothing(
    client, tenant, sessionmaker, start_worker, own_redis: OwnRedis
) -> None:
    env = {"TRAINYARD_REDIS_URL": own_redis.url}
    start_worker(**env)
    start_worker(**env)
    runs = [
        (await client.post("/runs", json=_body(), headers=tenant.headers)).json()["id"]
        for _ in range(3)
    ]
    # Two run on the workers; the third waits in the queue that is about to vanish.
    for run_id in runs[:2]:
        await wait_for(sessionmaker, run_id, lambda r: r.step >= 1, within=60)
    own_redis.stop()
    with pytest.raises(redis.ConnectionError):  # really gone, queue and connections
        own_redis.client().ping()
    own_redis.start()
    own_redis.client().flushall()
    for run_id in runs:  # every live run is running again
        await wait_for(
            sessionmaker,
            run_id,
            lambda r: r.lease_owner is not None or r.status == "completed",
            within=60,
        )
    for run_id in runs:
        await _completes_once(sessionmaker, run_id)


async def test_broker_down_at_create_time_the_run_starts_once_it_is_back(
    client, tenant, sessionmaker, start_worker, own_redis: OwnRedis
) -> None:
    worker = start_worker(TRAINYARD_REDIS_URL=own_redis.url)
    own_redis.stop()
    created = await client.post("/runs", json=_body(), headers=tenant.headers)
    assert created.status_code == 202  # Postgres is the outbox: the broker is not needed here
    run_id = created.json()["id"]
    # The worker heard of the run and could not hand it on: it waits, pending, in Postgres.
    await worker.wait_for_output(f"could not publish run {run_id}")
    assert (await get_run(sessionmaker, run_id)).status == "pending"
    own_redis.start()
    await _completes_once(sessionmaker, run_id)
    assert (await get_run(sessionmaker, run_id)).attempt == 1


async def test_a_rolled_back_create_notifies_no_one(own_database, tenant) -> None:
    """The due-run notification goes out after the create commits (the API process's
    DueBell): a create whose transaction rolls back (here refused at the project's active-run
    cap) rings nothing, so no worker ever hears of a run that does not exist."""
    listener = await asyncpg.connect(**connect_kwargs(own_database.url))
    heard: list[str] = []
    arrived = asyncio.Event()

    def on_notify(*args: Any) -> None:
        heard.append(args[-1])
        arrived.set()

    await listener.add_listener(DUE_CHANNEL, on_notify)
    pool = await create_pool(own_database.url, size=2)
    bell = DueBell(pool)
    bell.start()
    rings: list[bool] = []

    def due() -> None:
        rings.append(True)
        bell.ring()

    async def create() -> Any:
        async with pool.acquire() as conn:
            return await create_run(
                conn,
                tenant.project_id,
                RunCreate.model_validate(run_body()),
                policy=CodePolicy("open", Catalog()),
                max_active=1,
                due=due,
            )

    try:
        committed = await create()
        with pytest.raises(ActiveRunLimit):
            await create()  # rolled back: the cap is reached
        await asyncio.wait_for(arrived.wait(), 5)
        assert rings == [True] and heard == [""]
        ids = await pool.fetch("SELECT id FROM runs WHERE project_id = $1", tenant.project_id)
        assert [r["id"] for r in ids] == [committed.id]
    finally:
        await bell.aclose()
        await pool.close()
        await listener.close()
