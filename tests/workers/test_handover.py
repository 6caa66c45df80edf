"""A deploy: SIGTERM to the worker that holds a run. It checkpoints at the next step
boundary, hands the run back due at once, and exits; the other worker resumes it from that
checkpoint without using an attempt (real TRL on the tiny model)."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from app.checkpoints.models import Checkpoint
from tests.support.runs import events, series, trajectory_keys, wait_for
from tests.support.workers import letter_rows, letters_run


async def test_sigterm_hands_the_run_over_at_a_checkpoint_without_using_an_attempt(
    client: Any,
    tenant: Any,
    sessionmaker: Any,
    start_worker: Any,
    tiny_model: Path,
    worker_home: dict[str, str],
) -> None:
    # Re-dispatch of an unheld run only after 10 minutes: a prompt resume is the handover's.
    env = {
        **worker_home,
        "TRAINYARD_REDISPATCH_SECONDS": "600",
        "TRAINYARD_LEASE_TTL_SECONDS": "10",
    }
    workers = [start_worker(**env), start_worker(**env)]
    body = letters_run(
        tiny_model, max_steps=30, grpo={"save_steps": 100}
    )  # no checkpoint of its own
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    held = await wait_for(
        sessionmaker, run["id"], lambda r: r.step >= 5 and r.lease_owner is not None, within=180
    )
    owner = next(w for w in workers if held.lease_owner.endswith(f":{w.proc.pid}"))
    owner.kill(signal.SIGTERM)  # waits for the process to exit
    assert owner.proc.returncode == 0, owner.output()[-3000:]
    assert "handed over" in owner.output()

    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=240
    )
    assert done.status == "completed", done.error
    assert done.failures == 0 and done.attempt == 2
    stored = await events(sessionmaker, run["id"])
    (handover,) = [e for e in stored if e.type == "handover"]
    step = handover.data["step"]
    assert step >= 5
    (resumed,) = [e for e in stored if e.type == "resume"]
    assert f"step {step}" in resumed.message
    async with sessionmaker() as s:
        saved = await s.scalars(
            select(Checkpoint.step).where(
                Checkpoint.run_id == uuid.UUID(run["id"]), Checkpoint.is_final.is_(False)
            )
        )
        assert step in set(saved)
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(30)
    assert [s for s, _ in await series(sessionmaker, run["id"], "reward_mean")] == list(
        range(1, 31)
    )


@pytest.mark.chaos  # a process killed: the chaos tier (make test-chaos)
async def test_two_workers_on_shared_artifacts_the_survivor_resumes_a_killed_run(
    client: Any,
    tenant: Any,
    sessionmaker: Any,
    start_worker: Any,
    tiny_model: Path,
    worker_home: dict[str, str],
) -> None:
    """Both workers use one artifacts folder, as a fleet shares one: SIGKILL the one holding
    the run, and the other finds its checkpoint there and resumes from it."""
    workers = [start_worker(**worker_home), start_worker(**worker_home)]
    body = letters_run(tiny_model, max_steps=30, grpo={"save_steps": 10})
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    held = await wait_for(
        sessionmaker,
        run["id"],
        lambda r: r.status == "training" and 12 <= r.step < 20,
        within=180,
        every=0.005,
    )
    owner = next(w for w in workers if held.lease_owner.endswith(f":{w.proc.pid}"))
    owner.kill()  # SIGKILL: no handover, the lease runs out; checkpoint 10 is the last
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=240
    )
    assert done.status == "completed", done.error
    assert done.failures == 1
    survivor = next(w for w in workers if w is not owner)
    assert f"run {run['id']}: claimed (attempt 2)" in survivor.output()
    (resumed,) = [e for e in await events(sessionmaker, run["id"]) if e.type == "resume"]
    assert "step 10" in resumed.message
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(30)
