"""The training loop's one-statement moves: data and move together or neither, fenced on the
lease and the source status, every status change logged in order."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from app.core.pg import connect_kwargs, init_connection
from app.runs.lifecycle import step_moves
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.state import LeaseLost, TransitionConflict
from app.runs.lifecycle.status import RunStatus as S
from tests.support.runs import create_run

FENCE = Fence(owner="worker-a:1", attempt=1)


@pytest.fixture
async def conn(service_urls: tuple[str, str]) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(**connect_kwargs(service_urls[0]))
    await init_connection(c)
    try:
        yield c
    finally:
        await c.close()


async def _leased(sessionmaker: Any, tenant: Any, status: S) -> uuid.UUID:
    run = await create_run(
        sessionmaker,
        project_id=tenant.project_id,
        status=status,
        lease_owner=FENCE.owner,
        attempt=FENCE.attempt,
        lease_expires_at=datetime.now(UTC) + timedelta(seconds=5),
        learning_key="k-moves",
    )
    return run.id


def _rollouts(scored: bool) -> list[dict[str, Any]]:
    return [
        {
            "group_index": g,
            "rollout_index": r,
            "task_input_id": None,
            "messages": [{"role": "assistant", "content": f"g{g}r{r}\x00"}],
            "metadata": {"engine": "transformers"},
            **({"reward": 0.25 * r, "breakdown": {"f": 0.25 * r}} if scored else {}),
        }
        for g in range(2)
        for r in range(2)
    ]


async def _state(conn: asyncpg.Connection, run_id: uuid.UUID) -> dict[str, Any]:
    run = await conn.fetchrow(
        "SELECT status, version, step, epoch, metrics, lease_expires_at FROM runs WHERE id = $1",
        run_id,
    )
    events = await conn.fetch(
        "SELECT type, message, data FROM run_events WHERE run_id = $1 AND type <> 'created'"
        " ORDER BY id",
        run_id,
    )
    rows = await conn.fetch(
        "SELECT step, group_index, rollout_index, reward, project_id, learning_key, messages"
        " FROM trajectories WHERE run_id = $1 ORDER BY step, group_index, rollout_index",
        run_id,
    )
    return {"run": dict(run), "events": [dict(e) for e in events], "rows": [dict(r) for r in rows]}


async def test_scored_rollouts_move_collecting_to_training_in_one_statement(
    conn: asyncpg.Connection, sessionmaker: Any, tenant: Any
) -> None:
    run_id = await _leased(sessionmaker, tenant, S.COLLECTING)
    before = await _state(conn, run_id)
    await step_moves.rollouts_collected(
        conn, run_id, FENCE, 3, _rollouts(scored=True), ttl_seconds=60, scored=True
    )
    after = await _state(conn, run_id)
    assert after["run"]["status"] == "training"
    assert after["run"]["version"] == before["run"]["version"] + 1
    assert after["run"]["lease_expires_at"] > before["run"]["lease_expires_at"]  # renewed
    assert [(e["data"]["from"], e["data"]["to"]) for e in after["events"]] == [
        ("collecting", "scoring"),
        ("scoring", "training"),
    ]
    rows = after["rows"]
    assert [(r["step"], r["group_index"], r["rollout_index"]) for r in rows] == [
        (3, g, r) for g in range(2) for r in range(2)
    ]
    assert [r["reward"] for r in rows] == [0.0, 0.25, 0.0, 0.25]
    assert {(r["project_id"], r["learning_key"]) for r in rows} == {(tenant.project_id, "k-moves")}
    assert "\x00" not in json.dumps(rows[0]["messages"])  # NUL is stored as U+FFFD

    # The step ends: metrics, progress and the move back to collecting, with its events.
    await step_moves.step_finished(
        conn,
        run_id,
        FENCE,
        3,
        1,
        metrics={"reward_mean": 0.125, "loss": float("nan")},
        summary={"step": 3, "avg_reward": 0.125, "training_loss": float("nan")},
        last=False,
        event="step 3/9 done: reward 0.125",
        ttl_seconds=60,
    )
    done = await _state(conn, run_id)
    assert (done["run"]["status"], done["run"]["step"], done["run"]["epoch"]) == (
        "collecting",
        3,
        1,
    )
    assert done["run"]["metrics"] == {"step": 3, "avg_reward": 0.125, "training_loss": None}
    assert [(e["type"], e["message"]) for e in done["events"][2:]] == [
        ("status", "step 4: collecting rollouts"),
        ("step", "step 3/9 done: reward 0.125"),
    ]
    points = await conn.fetch(
        "SELECT name, value FROM metric_points WHERE run_id = $1 AND step = 3", run_id
    )
    assert {p["name"]: p["value"] for p in points} == {"reward_mean": 0.125}  # NaN skipped


async def test_judged_steps_move_twice_and_the_last_step_stays_in_training(
    conn: asyncpg.Connection, sessionmaker: Any, tenant: Any
) -> None:
    run_id = await _leased(sessionmaker, tenant, S.COLLECTING)
    await step_moves.rollouts_collected(
        conn, run_id, FENCE, 1, _rollouts(scored=False), ttl_seconds=60
    )
    state = await _state(conn, run_id)
    assert state["run"]["status"] == "scoring"
    assert all(r["reward"] is None for r in state["rows"])
    rewards = [
        {"group_index": g, "rollout_index": r, "reward": 0.5 + r, "breakdown": {"judge": "ok"}}
        for g in range(2)
        for r in range(2)
    ]
    await step_moves.rewards_scored(conn, run_id, FENCE, 1, rewards, ttl_seconds=60)
    state = await _state(conn, run_id)
    assert state["run"]["status"] == "training"
    assert [r["reward"] for r in state["rows"]] == [0.5, 1.5, 0.5, 1.5]
    await step_moves.step_finished(
        conn,
        run_id,
        FENCE,
        1,
        0,
        metrics={"reward_mean": 1.0},
        summary={"step": 1},
        last=True,
        event="step 1/1 done",
        ttl_seconds=60,
    )
    state = await _state(conn, run_id)
    assert (state["run"]["status"], state["run"]["step"]) == ("training", 1)
    assert [e["type"] for e in state["events"]] == ["status", "status", "step"]


async def test_a_stale_fence_or_wrong_status_writes_nothing(
    conn: asyncpg.Connection, sessionmaker: Any, tenant: Any
) -> None:
    run_id = await _leased(sessionmaker, tenant, S.COLLECTING)
    before = await _state(conn, run_id)
    stale = Fence(owner=FENCE.owner, attempt=FENCE.attempt - 1)
    with pytest.raises(LeaseLost):
        await step_moves.rollouts_collected(
            conn, run_id, stale, 1, _rollouts(scored=True), ttl_seconds=60, scored=True
        )
    with pytest.raises(TransitionConflict) as conflict:
        await step_moves.rewards_scored(conn, run_id, FENCE, 1, [], ttl_seconds=60)
    assert not isinstance(conflict.value, LeaseLost)
    assert await _state(conn, run_id) == before
    with pytest.raises(LeaseLost):
        await step_moves.rollouts_collected(conn, uuid.uuid4(), FENCE, 1, [], ttl_seconds=60)
