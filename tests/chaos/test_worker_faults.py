"""Workers killed, frozen and crashed in every phase: the run is reclaimed and completes with
every row exactly once; a worker that lost its lease changes nothing."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from app.events.models import RunEvent
from app.metrics.models import MetricPoint
from tests.conftest import run_body
from tests.workers.conftest import FAST
from tests.workers.test_leases import _events, _run, _trajectory_keys, wait_for

pytestmark = pytest.mark.chaos

TTL = float(FAST["TRAINYARD_LEASE_TTL_SECONDS"])
REAPER = float(FAST["TRAINYARD_REAPER_INTERVAL_SECONDS"])
STEPS, GROUPS, ROLLOUTS = 3, 2, 2
ALL_ROWS = [(s, g, r) for s in range(STEPS) for g in range(GROUPS) for r in range(ROLLOUTS)]


def _body(**config: Any) -> dict[str, Any]:
    return run_body(max_steps=STEPS, rollouts_per_group=ROLLOUTS, config={"tick": 0.6, **config})


def _owner(workers: list[Any], lease_owner: str | None) -> Any:
    """The worker whose process holds the lease (``host:pid``)."""
    assert lease_owner is not None
    return next(w for w in workers if lease_owner.endswith(f":{w.proc.pid}"))


async def _metric_steps(maker: Any, run_id: str) -> list[int]:
    async with maker() as s:
        rows = await s.execute(
            select(MetricPoint.step)
            .where(MetricPoint.run_id == uuid.UUID(run_id), MetricPoint.name == "reward_mean")
            .order_by(MetricPoint.step)
        )
        return list(rows.scalars())


async def _assert_complete_once(maker: Any, run_id: str, *, attempt: int) -> None:
    done = await wait_for(maker, run_id, lambda r: r.status in {"completed", "failed"}, within=60)
    assert done.status == "completed", done.error
    assert done.attempt == attempt and done.lease_owner is None and done.step == STEPS
    assert await _trajectory_keys(maker, run_id) == ALL_ROWS  # none missing, none doubled
    assert await _metric_steps(maker, run_id) == list(range(STEPS))


@pytest.mark.parametrize("phase", ["generating", "collecting", "scoring", "training"])
async def test_worker_killed_in_each_phase_is_reclaimed_within_ttl(
    client, tenant, sessionmaker, start_worker, phase: str
) -> None:
    # Both ready before the run exists: what is measured is the handover, not a boot.
    workers = [start_worker(), start_worker()]
    run = (await client.post("/runs", json=_body(), headers=tenant.headers)).json()
    step = 0 if phase == "generating" else 1
    held = await wait_for(
        sessionmaker, run["id"], lambda r: r.status == phase and r.step == step, every=0.02
    )
    first = _owner(workers, held.lease_owner)
    standby = next(w for w in workers if w is not first)
    first.kill()
    killed = time.monotonic()
    await wait_for(sessionmaker, run["id"], lambda r: r.attempt == 2, within=30, every=0.05)
    # Lease TTL + reaper interval, plus the redispatch and a heartbeat of slack.
    assert time.monotonic() - killed < TTL + REAPER + 2.5
    await _assert_complete_once(sessionmaker, run["id"], attempt=2)
    assert standby.proc.poll() is None


async def test_crash_before_the_first_heartbeat_is_recovered(
    client, tenant, sessionmaker, start_worker
) -> None:
    start_worker(pool="prefork")  # the parent replaces the child that dies
    run = (await client.post("/runs", json=_body(die_at_start=1), headers=tenant.headers)).json()
    await _assert_complete_once(sessionmaker, run["id"], attempt=2)


async def test_frozen_zombie_is_fenced_off_and_stops_itself(
    client, tenant, sessionmaker, start_worker
) -> None:
    zombie = start_worker()
    run = (await client.post("/runs", json=_body(tick=0.8), headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == "collecting" and r.step == 1)
    start_worker()
    zombie.kill(signal.SIGSTOP)  # frozen mid-phase, lease and all
    try:
        taken = await wait_for(sessionmaker, run["id"], lambda r: r.attempt == 2, within=30)
        owner = taken.lease_owner
        await wait_for(sessionmaker, run["id"], lambda r: r.step >= 2, within=30)
    finally:
        zombie.kill(signal.SIGCONT)
    # Woken, the zombie finds its fence stale at its next write or heartbeat and gives up.
    deadline = time.monotonic() + 15
    while "lease lost" not in zombie.output():
        assert time.monotonic() < deadline, zombie.output()[-3000:]
        await asyncio.sleep(0.1)
    assert (await _run(sessionmaker, run["id"])).lease_owner in {owner, None}
    await _assert_complete_once(sessionmaker, run["id"], attempt=2)
    # Every status change after the takeover is the new owner's single walk of the phases.
    events = await _events(sessionmaker, run["id"])
    claim = max(i for i, e in enumerate(events) if e.type == "lease")
    walk = [e.data["to"] for e in events[claim:] if e.type == "status"]
    assert walk[-1] == "completed"
    for a, b in itertools.pairwise(walk):
        assert (a, b) in {
            ("collecting", "scoring"),
            ("scoring", "training"),
            ("training", "collecting"),
            ("training", "completed"),
            ("pending", "collecting"),
            ("pending", "scoring"),
            ("pending", "training"),
        }, walk
    assert zombie.proc.poll() is None  # it stopped the run, not the process


@pytest.mark.parametrize("phase", ["generating", "collecting", "scoring", "training"])
async def test_cancel_in_each_phase_ends_within_a_heartbeat(
    client, tenant, sessionmaker, start_worker, phase: str
) -> None:
    start_worker()
    run = (await client.post("/runs", json=_body(tick=2.0), headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == phase, within=30, every=0.02)
    asked = time.monotonic()
    r = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "cancelled", within=10)
    # Heartbeat 0.25 s: the worker stops mid-tick, long before the 2 s phase would end.
    assert time.monotonic() - asked < 1.0
    assert done.lease_owner is None
    again = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    async with sessionmaker() as s:
        moves = await s.scalar(
            select(func.count())
            .select_from(RunEvent)
            .where(RunEvent.run_id == uuid.UUID(run["id"]), RunEvent.type == "status")
        )
    await asyncio.sleep(1.0)  # nothing moves after the cancel: the work really stopped
    async with sessionmaker() as s:
        later = await s.scalar(
            select(func.count())
            .select_from(RunEvent)
            .where(RunEvent.run_id == uuid.UUID(run["id"]), RunEvent.type == "status")
        )
    assert later == moves


async def test_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    """Real TRL: the worker dies inside checkpoint 20 (weights written, optimizer not). The
    half-written folder is never promoted nor recorded; the next worker resumes from
    checkpoint 10 (its step, optimizer, scheduler and data position) and finishes with every
    row exactly once."""
    from app.checkpoints.models import Checkpoint
    from tests.workers.test_pipeline import _full, letters_run, series

    env = {
        **worker_home,
        "TRAINYARD_PIPELINE": "tests.chaos.pipelines:dies_mid_checkpoint",
        # A fresh child's first import of torch holds the GIL for seconds on a busy machine:
        # longer than the 1.5 s lease of the other tests. This one is about the checkpoint.
        "TRAINYARD_LEASE_TTL_SECONDS": "10",
    }
    start_worker(pool="prefork", **env)  # the parent replaces the child that dies
    body = letters_run(
        tiny_model, max_steps=30, grpo={"save_steps": 10}, config={"die_at_checkpoint": 20}
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=300
    )
    assert done.status == "completed", done.error
    assert done.attempt == 2
    events = await _events(sessionmaker, run["id"])
    resumed = [e for e in events if e.type == "resume"]
    assert len(resumed) == 1 and "step 10" in resumed[0].message, [
        (e.type, e.message) for e in events
    ]
    assert await _trajectory_keys(sessionmaker, run["id"]) == _full(30)
    steps = [step for step, _ in await series(sessionmaker, run["id"], "reward_mean")]
    assert steps == list(range(1, 31))
    async with sessionmaker() as s:
        saved = await s.execute(
            select(Checkpoint.step).where(
                Checkpoint.run_id == uuid.UUID(run["id"]), Checkpoint.is_final.is_(False)
            )
        )
        assert sorted(saved.scalars()) == [10, 20, 30]


async def test_visibility_timeout_shorter_than_the_task_is_refused_by_the_lease(
    client, tenant, sessionmaker, start_worker
) -> None:
    """Redis hands the still-running task to the other worker after 2 s; the lease (and its
    fencing token) turns the duplicate away, so only one process ever does the work."""
    env = {"TRAINYARD_BROKER_VISIBILITY_TIMEOUT_SECONDS": "2"}
    workers = [start_worker(**env), start_worker(**env)]
    run = (
        await client.post(
            "/runs",
            json=run_body(max_steps=4, rollouts_per_group=ROLLOUTS, config={"tick": 1.0}),
            headers=tenant.headers,
        )
    ).json()
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "completed", within=90)
    assert done.attempt == 1  # never claimed twice
    claims = [e for e in await _events(sessionmaker, run["id"]) if e.type == "lease"]
    assert len(claims) == 1
    logs = "".join(w.output() for w in workers)
    # The redelivery happened (the same task received again) and was refused.
    assert f"run {run['id']}: not-claimed" in logs, logs[-4000:]
    rows = await _trajectory_keys(sessionmaker, run["id"])
    assert rows == [(s, g, r) for s in range(4) for g in range(GROUPS) for r in range(ROLLOUTS)]
