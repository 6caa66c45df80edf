"""The training-data queries' plans: each main shape is served by an index, never a
sequential scan of ``trajectories`` (checked on enough rows that the planner has a choice,
with fresh statistics, and nothing forced)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.auth.service import get_or_create_project
from app.core.pg import connect_kwargs, init_connection
from app.runs.lifecycle.status import RunStatus
from app.training_data.filters import Filters, trajectory_where
from app.training_data.queries import trajectory_select
from tests.support.runs import create_run

PROJECTS, RUNS_PER_PROJECT, ROWS_PER_RUN = 8, 3, 2500
NOW = datetime(2026, 11, 1, tzinfo=UTC)


class Shapes:
    def __init__(self, projects: list[uuid.UUID], runs: list[uuid.UUID], key: str) -> None:
        self.projects = projects
        self.runs = runs
        self.key = key


@pytest.fixture(scope="module")
async def shapes(
    sessionmaker: async_sessionmaker[AsyncSession], service_urls: tuple[str, str]
) -> AsyncIterator[Shapes]:
    tag = uuid.uuid4().hex[:6]
    key = f"plan-key-{tag}"
    projects, runs = [], []
    async with sessionmaker() as s:
        for i in range(PROJECTS):
            projects.append((await get_or_create_project(s, f"plan-{tag}-{i}")).id)
        await s.commit()
    for i, project in enumerate(projects):
        for j in range(RUNS_PER_PROJECT):
            run = await create_run(
                sessionmaker,
                project_id=project,
                status=RunStatus.COMPLETED if j else RunStatus.FAILED,
                learning_key=key if (i, j) == (0, 0) else f"other-{tag}-{i}-{j}",
            )
            runs.append(run.id)
    conn = await asyncpg.connect(**connect_kwargs(service_urls[0]))
    try:
        # Server-side rows: sixty thousand trajectories over 90 days, rewards spread 0..1.
        await conn.execute(
            """
            INSERT INTO trajectories (id, run_id, project_id, learning_key, step, group_index,
                                      rollout_index, messages, reward, created_at)
            SELECT gen_random_uuid(), r.id, r.project_id, r.learning_key, n / 8, (n / 4) % 2,
                   n % 4,
                   jsonb_build_array(jsonb_build_object('role', 'user', 'content',
                                                        repeat('x', 200 + n % 300))),
                   random(), $2::timestamptz - (random() * interval '90 days')
              FROM runs AS r CROSS JOIN generate_series(0, $3 - 1) AS n
             WHERE r.id = ANY($1::uuid[])
            """,
            runs,
            NOW,
            ROWS_PER_RUN,
        )
        await conn.execute("ANALYZE trajectories")
        await conn.execute("ANALYZE runs")
    finally:
        await conn.close()
    yield Shapes(projects, runs, key)


async def _plan(service_urls: tuple[str, str], sql: str, params: list[Any]) -> dict[str, Any]:
    conn = await asyncpg.connect(**connect_kwargs(service_urls[0]))
    await init_connection(conn)
    try:
        (plan,) = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *params)
        return dict(plan["Plan"])
    finally:
        await conn.close()


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in _nodes(child))]


def _check(plan: dict[str, Any], index: str) -> None:
    nodes = _nodes(plan)
    seq = [
        n
        for n in nodes
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "trajectories"
    ]
    assert not seq, f"sequential scan of trajectories: {plan}"
    used = {n.get("Index Name") for n in nodes}
    assert index in used, f"{index} not used; plan uses {used - {None}}"


def _page(
    f: Filters, *, after: Any = None, order: str = "newest", **kw: Any
) -> tuple[str, list[Any]]:
    return trajectory_select(
        f,
        f.project_ids,
        include_messages=True,
        include_metadata=True,
        order=order,  # type: ignore[arg-type]
        after=after,
        limit=101,
        **kw,
    )


def _main(s: Shapes) -> Filters:
    return Filters.build(
        project_ids=[s.projects[0]],
        min_reward=0.5,
        start_date=NOW - timedelta(days=80),
        end_date=NOW - timedelta(days=5),
    )


@pytest.mark.parametrize("order", ["newest", "oldest"])
async def test_main_page_walks_the_project_index(
    shapes: Shapes, service_urls: tuple[str, str], order: str
) -> None:
    f = _main(shapes)
    _check(await _plan(service_urls, *_page(f, order=order)), "ix_trajectories_project_created")
    deep = (NOW - timedelta(days=40), uuid.uuid4())
    plan = await _plan(service_urls, *_page(f, after=deep, order=order))
    _check(plan, "ix_trajectories_project_created")


async def test_other_shapes_use_their_indexes(
    shapes: Shapes, service_urls: tuple[str, str]
) -> None:
    cases = [
        (
            Filters.build(learning_key=shapes.key, min_reward=0.2),
            "ix_trajectories_learning_key_created",
        ),
        (Filters.build(run_ids=[shapes.runs[4]]), "ix_trajectories_run_created"),
        (Filters.build(min_reward=0.99), "ix_trajectories_created"),
        (
            Filters.build(project_ids=[shapes.projects[1]], statuses=["failed"]),
            "ix_trajectories_project_created",
        ),
        (
            Filters.build(project_ids=[shapes.projects[2]], steps=[3]),
            "ix_trajectories_project_created",
        ),
    ]
    for f, index in cases:
        _check(await _plan(service_urls, *_page(f)), index)
    stats = _page(_main(shapes), include_group_stats=True)
    _check(await _plan(service_urls, *stats), "uq_trajectories_run_step_group_rollout")


async def test_count_reads_the_index_not_the_table(
    shapes: Shapes, service_urls: tuple[str, str]
) -> None:
    f = _main(shapes)
    w = trajectory_where(f, f.project_ids)
    plan = await _plan(
        service_urls, f"SELECT count(*) FROM trajectories AS t WHERE {w.sql()}", w.params
    )
    _check(plan, "ix_trajectories_project_created")


async def test_lookup_by_id_uses_the_primary_key(
    shapes: Shapes, service_urls: tuple[str, str]
) -> None:
    plan = await _plan(
        service_urls,
        "SELECT * FROM trajectories AS t WHERE t.id = $1 AND t.project_id = $2",
        [uuid.uuid4(), shapes.projects[0]],
    )
    _check(plan, "trajectories_pkey")
