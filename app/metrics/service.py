from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from app.core.sql import Where, json_object
from app.core.storable import storable_number
from app.events.service import LATEST_EVENT
from app.metrics.models import MetricSeries, Point, RunMetrics

MAX_POINTS = 100_000  # one answer's points, all series together

_RECORD = text(
    """
    INSERT INTO metric_points (run_id, step, name, value)
    SELECT :run_id, :step, m.key, m.value::float8
      FROM jsonb_each(CAST(:values AS jsonb)) AS m(key, value)
    ON CONFLICT (run_id, name, step) DO UPDATE SET value = EXCLUDED.value
    """
)


def storable_values(values: dict[str, float]) -> dict[str, float]:
    """The values a metric point can hold: finite numbers, names cut to the column's 128."""
    return {
        name[:128]: number
        for name, value in values.items()
        if (number := storable_number(value)) is not None
    }


async def record(
    session: AsyncSession, run_id: uuid.UUID, step: int, values: dict[str, float]
) -> None:
    """Store one value per metric name at ``step`` (a redone step overwrites). One
    statement, the values as one JSON parameter (evaluations; a training step's metrics go
    with its status move, ``app.runs.lifecycle.step_moves.step_finished``).

    Every write of a run's metric points appends a run event in the same transaction: the
    run's last event id is the ETag of its metrics too (app/events/conditional.py)."""
    finite = storable_values(values)
    if finite:
        await session.execute(
            _RECORD, {"run_id": run_id, "step": step, "values": json.dumps(finite)}
        )


@dataclass(frozen=True, slots=True)
class RenderedMetrics:
    body: str  # RunMetrics as JSON
    latest: int  # the run's last event id, from the same snapshot (its ETag)


async def run_metrics(
    pool: asyncpg.Pool,
    project_id: uuid.UUID,
    run_id: uuid.UUID,
    *,
    names: Sequence[str] | None = None,
    step_min: int | None = None,
    step_max: int | None = None,
) -> RenderedMetrics | None:
    """The run's metric series by name, each by step: ``RunMetrics`` as JSON, at most
    :data:`MAX_POINTS` points; None when the project has no such run. One statement: every
    client of a live run polls this."""
    w = Where([run_id, project_id, MAX_POINTS])
    if names:
        w.among("m.name", names, "text")
    if step_min is not None:
        w.add(f"m.step >= {w.param(step_min)}")
    if step_max is not None:
        w.add(f"m.step <= {w.param(step_max)}")
    async with pool.acquire() as conn:
        row = await conn.fetchrow(_RUN_METRICS.format(filters=w.sql()), *w.params)
    return RenderedMetrics(row["body"], row["latest"]) if row["visible"] else None


# RunMetrics as the API shows it, rendered by PostgreSQL: every client of a live run polls
# this, so no ORM and no Python object per point (docs/benchmarks.md, pollers). Each object
# is its model's fields; a value that is not a finite number (which JSON cannot hold and the
# writers refuse, ``storable_values``) is left out rather than rendered as a string.
_POINT = json_object(Point)
_SERIES = json_object(MetricSeries)
_BODY = json_object(
    RunMetrics,
    {
        "run_id": "$1::uuid",
        "series": f"(SELECT coalesce(json_agg({_SERIES} ORDER BY name), '[]'::json) FROM series)",
    },
)
_RUN_METRICS = f"""
WITH run AS (
    SELECT id FROM runs WHERE id = $1 AND project_id = $2
), points AS (
    SELECT m.name, m.step, m.value
      FROM metric_points AS m JOIN run ON m.run_id = run.id
     WHERE {{filters}} AND m.value NOT IN ('NaN', 'Infinity', '-Infinity')
     ORDER BY m.name, m.step
     LIMIT $3
), series AS (
    SELECT name, json_agg({_POINT} ORDER BY step) AS points FROM points GROUP BY name
)
SELECT EXISTS (SELECT 1 FROM run) AS visible, {LATEST_EVENT} AS latest, {_BODY}::text AS body
"""
