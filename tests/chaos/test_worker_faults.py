"""Workers killed, frozen and crashed in every phase: the run is reclaimed and completes with
every row exactly once; a worker that lost its lease changes nothing."""

from __future__ import annotations

import itertools
import signal
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from tests.support.runs import (
    events,
    get_run,
    run_body,
    series,
    status_walk,
    trajectory_keys,
    wait_for,
)
from tests.support.workers import letter_rows, letters_run

pytestmark = pytest.mark.chaos

STEPS, GROUPS, ROLLOUTS = 3, 2, 2
ALL_ROWS = [(s, g, r) for s in range(STEPS) for g in range(GROUPS) for r in range(ROLLOUTS)]


def _body(**config: Any) -> dict[str, Any]:
    return run_body(max_steps=STEPS, rollouts_per_group=ROLLOUTS, config={"tick": 0.6, **config})


def _owner(workers: list[Any], lease_owner: str | None) -> Any:
    """The worker whose process holds the lease (``host:pid``)."""
    assert lease_owner is not None
    return next(w for w in workers if lease_owner.endswith(f":{w.proc.pid}"))


async def _assert_complete_once(maker: Any, run_id: str, *, attempt: int) -> None:
    done = await wait_for(maker, run_id, lambda r: r.status in {"completed", "failed"}, within=60)
    assert done.status == "completed", done.error
    assert done.attempt == attempt and done.lease_owner is None and done.step == STEPS
    assert await trajectory_keys(maker, run_id) == ALL_ROWS  # none missing, none doubled
    assert [step for step, _ in await series(maker, run_id, "reward_mean")] == list(range(STEPS))


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
    taken = await wait_for(sessionmaker, run["id"], lambda r: r.attempt == 2, every=0.05)
    # The standby took it over once the reaper found the dead worker's lease expired: the
    # lease, not a redelivery of the task, handed the run on.
    assert _owner(workers, taken.lease_owner) is standby
    expiries = [e.message for e in await events(sessionmaker, run["id"]) if "expired" in e.message]
    assert len(expiries) == 1 and expiries[0].startswith(f"lease of {held.lease_owner} expired")
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
    await zombie.wait_for_output("lease lost")
    assert (await get_run(sessionmaker, run["id"])).lease_owner in {owner, None}
    await _assert_complete_once(sessionmaker, run["id"], attempt=2)
    # Every status change after the takeover is the new owner's single walk of the phases.
    stored = await events(sessionmaker, run["id"])
    claim = max(i for i, e in enumerate(stored) if e.type == "lease")
    walk = [e.data["to"] for e in stored[claim:] if e.type == "status"]
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
    worker = start_worker()
    # The phase lasts an hour: only the heartbeat, delivering the flag, can end it now.
    body = _body(tick=0.05, stall_in=phase)
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    await wait_for(sessionmaker, run["id"], lambda r: r.status == phase, every=0.02)
    r = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "cancelled")
    assert done.lease_owner is None
    again = await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    # The task has returned: nothing of the run is still working, and it left the phase
    # it stalled in for nothing but the cancel.
    await worker.wait_for_output(f"run {run['id']}: cancelled")
    walk = await status_walk(sessionmaker, run["id"])
    assert walk[-2:] == [phase, "cancelled"] and walk.count("cancelled") == 1, walk


async def test_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    """Real TRL: the worker dies inside checkpoint 20 (weights written, optimizer not). The
    half-written folder is never promoted nor recorded; the next worker resumes from
    checkpoint 10 (its step, optimizer, scheduler and data position) and finishes with every
    row exactly once."""
    from app.checkpoints.models import Checkpoint

    env = {
        **worker_home,
        "TRAINYARD_PIPELINE": "tests.support.pipelines:dies_mid_checkpoint",
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
    stored = await events(sessionmaker, run["id"])
    resumed = [e for e in stored if e.type == "resume"]
    assert len(resumed) == 1 and "step 10" in resumed[0].message, [
        (e.type, e.message) for e in stored
    ]
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(30)
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
    claims = [e for e in await events(sessionmaker, run["id"]) if e.type == "lease"]
    assert len(claims) == 1
    logs = "".join(w.output() for w in workers)
    # The redelivery happened (the same task received again) and was refused.
    assert f"run {run['id']}: not-claimed" in logs, logs[-4000:]
    rows = await trajectory_keys(sessionmaker, run["id"])
    assert rows == [(s, g, r) for s in range(4) for g in range(GROUPS) for r in range(ROLLOUTS)]


async def test_cancel_lands_in_the_middle_of_a_long_generation(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    """64 rollouts of up to 4,000 tokens: a step's generation lasts many seconds on the CPU.
    Cancelled as the second step's generation starts, the run stops within the generation
    (a stopping criterion reads the flag the heartbeat sets), storing none of that step."""
    worker = start_worker(**worker_home, TRAINYARD_LEASE_TTL_SECONDS="10")
    body = letters_run(
        tiny_model,
        max_steps=50,
        rollouts_per_group=16,
        grpo={"groups_per_step": 4, "max_completion_length": 4000, "save_steps": 1000},
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    await wait_for(
        sessionmaker,
        run["id"],
        lambda r: r.status == "collecting" and r.step >= 1,
        within=300,
        every=0.02,
    )
    assert (await client.post(f"/runs/{run['id']}/cancel", headers=tenant.headers)).is_success
    done = await wait_for(sessionmaker, run["id"], lambda r: r.status == "cancelled", within=120)
    assert done.step == 1
    await worker.wait_for_output("cancelled mid-generation; generation stops")
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(1, groups=4, rollouts=16)
