"""The training-data statements, on one asyncpg connection. The library and the REST API both
call these; neither builds SQL of its own.

Every list is ordered by ``(created_at, id)`` and continued from a keyset position, so a
page deep into ten million rows costs what the first page costs, and rows written while a
client pages through appear at the front (newest first) or the end (oldest first), never
shifting or repeating a page. Loading fewer columns really skips them: ``messages`` (the
bulk of a row) and ``reward_breakdown``/``metadata`` are left out of the ``SELECT``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from typing import Any

import asyncpg

from app.core.sql import Where
from app.training_data.filters import (
    Filters,
    Order,
    TrainingDataError,
    run_where,
    trajectory_where,
)
from app.training_data.records import TrainingRun, TrainingTrajectory

Position = tuple[datetime, uuid.UUID]

_BASE_COLUMNS = (
    "t.id, t.run_id, t.project_id, t.learning_key, t.step, t.group_index, t.rollout_index,"
    " t.task_input_id, t.reward, t.created_at"
)
# Over the whole group, whatever the filters kept (the unique index finds its few rows).
_GROUP_STATS = """
LEFT JOIN LATERAL (
    SELECT avg(g.reward) AS group_reward_mean, stddev_pop(g.reward) AS group_reward_std,
           count(g.reward) AS group_size
      FROM trajectories AS g
     WHERE g.run_id = t.run_id AND g.step = t.step AND g.group_index = t.group_index
) AS gs ON true"""
_RUN_COLUMNS = (
    "r.id, r.project_id, r.learning_key, r.status, r.model_name, r.trained_model_name,"
    " r.task_description, r.step, r.metrics, r.error, r.created_at, r.completed_at"
)


async def resolve_projects(conn: asyncpg.Connection, f: Filters) -> tuple[uuid.UUID, ...] | None:
    """The project ids the filters name (by id or name); an unknown project is an error, not
    an empty result, so a typo does not read as "no data"."""
    if f.project_ids is not None:
        return f.project_ids
    if f.projects is None:
        return None
    rows = await conn.fetch(
        "SELECT id, name FROM projects WHERE name = ANY($1::text[]) OR id::text = ANY($1::text[])",
        list(f.projects),
    )
    known = {r["name"] for r in rows} | {str(r["id"]) for r in rows}
    missing = [p for p in f.projects if p not in known]
    if missing:
        raise TrainingDataError("projects", f"no project named {', '.join(map(repr, missing))}")
    return tuple(r["id"] for r in rows)


def _keyset(w: Where, alias: str, order: Order, after: Position | None) -> str:
    if after is not None:
        op = "<" if order == "newest" else ">"
        created, id_ = after
        w.add(f"({alias}.created_at, {alias}.id) {op} ({w.param(created)}, {w.param(id_)})")
    direction = "DESC" if order == "newest" else "ASC"
    return f"ORDER BY {alias}.created_at {direction}, {alias}.id {direction}"


def _columns(*, include_messages: bool, include_metadata: bool, include_group_stats: bool) -> str:
    """The SELECT list in :class:`TrainingTrajectory`'s field order (a column left out is a
    typed NULL in its place), so rows become records positionally: ``dict(row)`` and keyword
    arguments cost more per row than the query itself once messages are skipped."""
    columns = _BASE_COLUMNS
    columns += ", t.messages" if include_messages else ", NULL::jsonb"
    if include_metadata:
        columns += ", t.reward_breakdown, t.metadata"
    else:
        columns += ", NULL::jsonb, NULL::jsonb"
    if include_group_stats:
        columns += ", gs.group_reward_mean, gs.group_reward_std, gs.group_size"
    return columns


def _records(rows: list[asyncpg.Record]) -> list[TrainingTrajectory]:
    return [TrainingTrajectory(*row) for row in rows]


def trajectory_select(
    f: Filters,
    project_ids: Sequence[uuid.UUID] | None,
    *,
    include_messages: bool,
    include_metadata: bool,
    include_group_stats: bool = False,
    order: Order,
    after: Position | None,
    limit: int | None,
) -> tuple[str, list[Any]]:
    """The page query and its parameters (also what the EXPLAIN tests look at)."""
    w = trajectory_where(f, project_ids)
    columns = _columns(
        include_messages=include_messages,
        include_metadata=include_metadata,
        include_group_stats=include_group_stats,
    )
    joins = _GROUP_STATS if include_group_stats else ""
    order_by = _keyset(w, "t", order, after)
    limit_sql = f" LIMIT {w.param(limit)}" if limit is not None else ""
    sql = f"SELECT {columns} FROM trajectories AS t{joins} WHERE {w.sql()} {order_by}{limit_sql}"
    return sql, w.params


async def fetch_trajectories(
    conn: asyncpg.Connection,
    f: Filters,
    *,
    include_messages: bool = True,
    include_metadata: bool = True,
    include_group_stats: bool = False,
    order: Order = "newest",
    after: Position | None = None,
    limit: int | None = None,
) -> list[TrainingTrajectory]:
    project_ids = await resolve_projects(conn, f)
    sql, params = trajectory_select(
        f,
        project_ids,
        include_messages=include_messages,
        include_metadata=include_metadata,
        include_group_stats=include_group_stats,
        order=order,
        after=after,
        limit=limit,
    )
    return _records(await conn.fetch(sql, *params))


async def count_trajectories(conn: asyncpg.Connection, f: Filters) -> int:
    w = trajectory_where(f, await resolve_projects(conn, f))
    count = await conn.fetchval(
        f"SELECT count(*) FROM trajectories AS t WHERE {w.sql()}", *w.params
    )
    return int(count)


async def fetch_trajectory(
    conn: asyncpg.Connection,
    trajectory_id: uuid.UUID,
    *,
    project_ids: Sequence[uuid.UUID] | None = None,
    include_messages: bool = True,
    include_metadata: bool = True,
) -> TrainingTrajectory | None:
    """One trajectory by id; ``None`` when unknown or outside ``project_ids``."""
    w = Where([trajectory_id])
    w.add("t.id = $1")
    if project_ids is not None:
        w.among("t.project_id", project_ids, "uuid")
    columns = _columns(
        include_messages=include_messages,
        include_metadata=include_metadata,
        include_group_stats=False,
    )
    row = await conn.fetchrow(f"SELECT {columns} FROM trajectories AS t WHERE {w.sql()}", *w.params)
    return TrainingTrajectory(*row) if row is not None else None


async def _keyset_batches(
    conn: asyncpg.Connection,
    select: Callable[[Position | None, int], tuple[str, list[Any]]],
    position: Callable[[asyncpg.Record], Position],
    *,
    batch_size: int,
    after: Position | None,
    limit: int | None,
) -> AsyncIterator[list[asyncpg.Record]]:
    """Rows of ``select(after, size)`` batch after batch, each continuing from the last row's
    keyset ``position``, until a short batch or ``limit`` rows. Each batch is its own query:
    nothing (transaction, cursor) is held open between batches."""
    left = limit
    while left is None or left > 0:
        size = batch_size if left is None else min(batch_size, left)
        sql, params = select(after, size)
        rows = await conn.fetch(sql, *params)
        if not rows:
            return
        yield rows
        if len(rows) < size:
            return
        after = position(rows[-1])
        if left is not None:
            left -= len(rows)


def _position(row: asyncpg.Record) -> Position:
    return (row["created_at"], row["id"])


async def trajectory_pages(
    conn: asyncpg.Connection,
    f: Filters,
    *,
    batch_size: int,
    include_messages: bool = True,
    include_metadata: bool = True,
    include_group_stats: bool = False,
    order: Order = "newest",
    after: Position | None = None,
    limit: int | None = None,
) -> AsyncIterator[list[TrainingTrajectory]]:
    """Batches of at most ``batch_size`` until the filters (or ``limit`` rows) run out."""
    project_ids = await resolve_projects(conn, f)

    def select(position: Position | None, size: int) -> tuple[str, list[Any]]:
        return trajectory_select(
            f,
            project_ids,
            include_messages=include_messages,
            include_metadata=include_metadata,
            include_group_stats=include_group_stats,
            order=order,
            after=position,
            limit=size,
        )

    async for rows in _keyset_batches(
        conn, select, _position, batch_size=batch_size, after=after, limit=limit
    ):
        yield _records(rows)


# One JSON Lines record per trajectory. PostgreSQL hands over the JSONB columns as their
# text (``::text``) and the line is put together here: about 1.5x the rows per second of
# ``json_build_object`` (which re-renders every value on the server), and no row's JSON is
# ever decoded into Python objects only to be encoded again.
_JSONL_COLUMNS = (
    "t.created_at, t.id, t.run_id, t.project_id, t.learning_key, t.step, t.group_index,"
    " t.rollout_index, t.task_input_id, t.reward"
)


def _jsonl_select(
    f: Filters,
    project_ids: Sequence[uuid.UUID] | None,
    *,
    include_messages: bool,
    include_metadata: bool,
    order: Order,
    after: Position | None,
    limit: int,
) -> tuple[str, list[Any]]:
    columns = _JSONL_COLUMNS
    columns += ", t.messages::text" if include_messages else ", NULL::text"
    if include_metadata:
        columns += ", t.reward_breakdown::text, t.metadata::text"
    else:
        columns += ", NULL::text, NULL::text"
    w = trajectory_where(f, project_ids)
    order_by = _keyset(w, "t", order, after)
    sql = (
        f"SELECT {columns} FROM trajectories AS t WHERE {w.sql()} {order_by} LIMIT {w.param(limit)}"
    )
    return sql, w.params


def _json_text(value: str | None) -> str:
    return "null" if value is None else json.dumps(value, ensure_ascii=False)


def _json_uuid(value: uuid.UUID | None) -> str:
    return "null" if value is None else f'"{value}"'


def jsonl_line(row: asyncpg.Record) -> str:
    """One export line: the fields of ``GET /trajectories/{id}`` (the JSONB ones only when
    they were selected), as one JSON object."""
    (created, id_, run, project, key, step, group, rollout, task_input, reward) = row[:10]
    messages, breakdown, metadata = row[10:13]
    line = (
        f'{{"id":"{id_}","run_id":"{run}","project_id":"{project}",'
        f'"learning_key":{_json_text(key)},"step":{step},"group_index":{group},'
        f'"rollout_index":{rollout},"task_input_id":{_json_uuid(task_input)},'
        f'"reward":{"null" if reward is None else repr(reward)},'
        f'"created_at":"{created.isoformat()}"'
    )
    if messages is not None:
        line += f',"messages":{messages}'
    if breakdown is not None:
        line += f',"reward_breakdown":{breakdown},"metadata":{metadata}'
    return line + "}"


async def jsonl_chunks(
    conn: asyncpg.Connection,
    f: Filters,
    *,
    batch_size: int = 2000,
    include_messages: bool = True,
    include_metadata: bool = True,
    order: Order = "newest",
    limit: int | None = None,
) -> AsyncIterator[str]:
    """The matching trajectories as JSON Lines, one chunk of up to ``batch_size`` lines at a
    time (each ending in a newline)."""
    project_ids = await resolve_projects(conn, f)

    def select(position: Position | None, size: int) -> tuple[str, list[Any]]:
        return _jsonl_select(
            f,
            project_ids,
            include_messages=include_messages,
            include_metadata=include_metadata,
            order=order,
            after=position,
            limit=size,
        )

    async for rows in _keyset_batches(
        conn, select, _position, batch_size=batch_size, after=None, limit=limit
    ):
        yield "".join(f"{jsonl_line(row)}\n" for row in rows)


async def fetch_runs(
    conn: asyncpg.Connection,
    f: Filters,
    *,
    order: Order = "newest",
    after: Position | None = None,
    limit: int | None = None,
) -> list[TrainingRun]:
    w = run_where(f, await resolve_projects(conn, f))
    order_by = _keyset(w, "r", order, after)
    limit_sql = f" LIMIT {w.param(limit)}" if limit is not None else ""
    rows = await conn.fetch(
        f"SELECT {_RUN_COLUMNS} FROM runs AS r WHERE {w.sql()} {order_by}{limit_sql}", *w.params
    )
    return [TrainingRun(**dict(row)) for row in rows]


async def count_runs(conn: asyncpg.Connection, f: Filters) -> int:
    w = run_where(f, await resolve_projects(conn, f))
    return int(await conn.fetchval(f"SELECT count(*) FROM runs AS r WHERE {w.sql()}", *w.params))
