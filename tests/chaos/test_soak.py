"""Fifty runs at once through two workers (the ticking pipeline, real Celery, real leases):
every run completes, every rollout is stored once, every step's metric once."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from app.metrics.models import MetricPoint
from app.runs.models import Run
from app.trajectories.models import Trajectory
from tests.support.runs import run_body, wait_for

pytestmark = pytest.mark.chaos

RUNS, STEPS, GROUPS, ROLLOUTS = 50, 3, 2, 2


async def test_fifty_concurrent_runs_through_two_workers(
    client: Any, tenant: Any, sessionmaker: Any, start_worker: Any
) -> None:
    start_worker()
    start_worker()
    body = run_body(max_steps=STEPS, rollouts_per_group=ROLLOUTS, config={"tick": 0.02})
    created = await asyncio.gather(
        *(client.post("/runs", json=body, headers=tenant.headers) for _ in range(RUNS))
    )
    assert [r.status_code for r in created] == [202] * RUNS
    ids = [uuid.UUID(r.json()["id"]) for r in created]
    for run_id in ids:
        done = await wait_for(
            sessionmaker, str(run_id), lambda r: r.status in {"completed", "failed"}, within=600
        )
        assert done.status == "completed", done.error
    async with sessionmaker() as s:
        rows = await s.execute(
            select(
                Trajectory.run_id,
                func.count(),
                func.count(
                    func.distinct(
                        func.concat(
                            Trajectory.step,
                            ":",
                            Trajectory.group_index,
                            ":",
                            Trajectory.rollout_index,
                        )
                    )
                ),
            )
            .where(Trajectory.run_id.in_(ids))
            .group_by(Trajectory.run_id)
        )
        per_run = {run_id: (n, distinct) for run_id, n, distinct in rows}
        points = dict(
            (
                await s.execute(
                    select(MetricPoint.run_id, func.count())
                    .where(MetricPoint.run_id.in_(ids), MetricPoint.name == "reward_mean")
                    .group_by(MetricPoint.run_id)
                )
            ).all()
        )
        attempts = list(await s.scalars(select(Run.attempt).where(Run.id.in_(ids))))
    expected = STEPS * GROUPS * ROLLOUTS
    assert per_run == {run_id: (expected, expected) for run_id in ids}
    assert points == {run_id: STEPS for run_id in ids}
    # Nothing was taken over: two workers shared fifty runs without losing a lease.
    assert attempts == [1] * RUNS
