"""Runs as tests make and read them: a valid request body, keyword-only factories for rows
the API would otherwise have to create, and reads of what the workers stored."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.core.pg import connect_kwargs
from app.events.models import RunEvent
from app.metrics.models import MetricPoint
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from app.runs.repository import insert_run
from app.runs.spec.body import RunCreate
from app.trajectories.models import Trajectory
from tests.support.workers import letters_run

Maker = async_sessionmaker[AsyncSession]


def run_body(**overrides: Any) -> dict[str, Any]:
    """A valid run-create body (function reward, two inline inputs)."""
    body: dict[str, Any] = {
        "model_name": "tiny-llama",
        "task_description": "Answer with the letter a.",
        "inputs": [{"input_text": "say a"}, {"input_text": "say aa"}],
        "reward": {
            "type": "function",
            "functions": [{"name": "char_fraction", "args": {"char": "a"}}],
        },
    }
    body.update(overrides)
    return body


def _url(maker: Maker) -> str:
    return str(maker.kw["bind"].url.render_as_string(hide_password=False))


async def create_run(
    maker: Maker,
    *,
    project_id: uuid.UUID,
    status: RunStatus = RunStatus.PENDING,
    **fields: Any,
) -> Run:
    """A committed run, forced into ``status`` (bypassing the state machine on purpose)."""
    conn = await asyncpg.connect(**connect_kwargs(_url(maker)))
    try:
        await conn.set_type_codec(
            "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
        )
        created = await insert_run(conn, project_id, RunCreate.model_validate(run_body()))
    finally:
        await conn.close()
    async with maker() as s:
        values: dict[str, Any] = {"status": status.value, **fields}
        run = (
            await s.execute(
                update(Run).where(Run.id == created["id"]).values(**values).returning(Run)
            )
        ).scalar_one()
        await s.commit()
        return run


async def add_trajectories(
    maker: Maker, run_id: uuid.UUID, step: int, count: int, **row: Any
) -> None:
    """``count`` rollouts of one group at ``step`` of the run (its project and learning key
    copied as the workers' writes copy them); ``row`` overrides columns (``reward`` …)."""
    conn = await asyncpg.connect(**connect_kwargs(_url(maker)))
    try:
        await conn.executemany(
            """
            INSERT INTO trajectories (id, run_id, project_id, learning_key, step, group_index,
                                      rollout_index, messages, reward)
            SELECT gen_random_uuid(), id, project_id, learning_key, $2, 0, $3, $4::jsonb, $5
              FROM runs WHERE id = $1
            """,
            [
                (
                    run_id,
                    step,
                    i,
                    json.dumps(row.get("messages", [{"role": "assistant", "content": "a"}])),
                    row.get("reward", 0.5),
                )
                for i in range(count)
            ],
        )
    finally:
        await conn.close()


async def add_episodes(maker: Maker, run_id: uuid.UUID, count: int) -> list[uuid.UUID]:
    """``count`` gateway episodes of step 1 waiting to be claimed, as the worker's pusher
    writes them (one group, a one-message prompt); their ids in rollout order."""
    ids = [uuid.uuid4() for _ in range(count)]
    conn = await asyncpg.connect(**connect_kwargs(_url(maker)))
    try:
        await conn.executemany(
            """
            INSERT INTO episodes (id, run_id, phase, step, slot, group_index, rollout_index,
                                  prompt, context, status, attempt, issued, max_issues,
                                  max_calls, timeout_seconds, metrics)
            VALUES ($1, $2, 'train', 1, $3, 0, $3, '[{"role": "user", "content": "hi"}]',
                    '{}', 'pending', 1, 0, 3, 8, 60, '{}')
            """,
            [(episode, run_id, i) for i, episode in enumerate(ids)],
        )
    finally:
        await conn.close()
    return ids


async def get_run(maker: Maker, run_id: str) -> Run:
    async with maker() as s:
        run = await s.get(Run, uuid.UUID(run_id))
        assert run is not None
        return run


async def wait_for(
    maker: Maker,
    run_id: str,
    predicate: Callable[[Run], bool],
    within: float = 30,
    every: float = 0.1,
) -> Run:
    """The run, once ``predicate`` holds for it. ``within`` is a generous deadline that only
    turns a hang into a failure; no test asserts how fast something happened."""
    deadline = time.monotonic() + within
    while True:
        run = await get_run(maker, run_id)
        if predicate(run):
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; run is {run.status} step {run.step}: {run.error}")
        await asyncio.sleep(every)


async def finished(maker: Maker, run_id: str, within: float = 400) -> Run:
    """The run once it has stopped: completed, failed, cancelled or paused."""
    return await wait_for(
        maker,
        run_id,
        lambda r: r.status in {"completed", "failed", "cancelled", "paused"},
        within=within,
    )


async def events(maker: Maker, run_id: str) -> list[RunEvent]:
    """The run's events, oldest first."""
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


async def status_walk(maker: Maker, run_id: str) -> list[str]:
    """Every status the run moved to, in order."""
    return [e.data["to"] for e in await events(maker, run_id) if e.type == "status"]


async def trajectory_keys(maker: Maker, run_id: str) -> list[tuple[int, int, int]]:
    """The run's (step, group, rollout) of every stored trajectory, sorted."""
    async with maker() as s:
        rows = await s.execute(
            select(Trajectory.step, Trajectory.group_index, Trajectory.rollout_index).where(
                Trajectory.run_id == uuid.UUID(run_id)
            )
        )
        return sorted((step, group, rollout) for step, group, rollout in rows)


async def series(maker: Maker, run_id: str, name: str) -> list[tuple[int, float]]:
    """The run's (step, value) points of one metric, by step."""
    async with maker() as s:
        rows = await s.execute(
            select(MetricPoint.step, MetricPoint.value)
            .where(MetricPoint.run_id == uuid.UUID(run_id), MetricPoint.name == name)
            .order_by(MetricPoint.step)
        )
        return [(step, value) for step, value in rows]


async def learning(
    client: Any,
    tenant: Any,
    maker: Maker,
    model: Path,
    grpo_by_label: dict[Any, dict[str, Any]],
    seeds: tuple[int, ...] = (1, 2),
    steps: int = 40,
) -> tuple[dict[Any, list[float]], dict[Any, list[float]]]:
    """The letters run on ``model`` once per seed and configuration (its ``grpo`` merged in),
    each completed: the mean reward of its first and of its last 10 steps, by label."""
    first: dict[Any, list[float]] = {label: [] for label in grpo_by_label}
    last: dict[Any, list[float]] = {label: [] for label in grpo_by_label}
    for seed in seeds:
        for label, grpo in grpo_by_label.items():
            body = letters_run(model, max_steps=steps, grpo={"seed": seed, **grpo})
            created = await client.post("/runs", json=body, headers=tenant.headers)
            done = await finished(maker, created.json()["id"])
            assert done.status == "completed", done.error
            curve = [v for _, v in await series(maker, str(done.id), "reward_mean")]
            assert len(curve) == steps
            first[label].append(statistics.fmean(curve[:10]))
            last[label].append(statistics.fmean(curve[-10:]))
    print(f"first 10 steps: {first}; last 10: {last}")
    return first, last
