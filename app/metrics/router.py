from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel

from app.auth.deps import Caller
from app.core.columns import INT32_MAX
from app.core.errors import INCONSISTENT, NotFound, Problem, problem_responses
from app.core.sql import Where
from app.core.storable import NO_NUL

router = APIRouter(prefix="/runs/{run_id}/metrics", tags=["metrics"])

MAX_POINTS = 100_000


class Point(BaseModel):
    step: int
    value: float


class MetricSeries(BaseModel):
    name: str
    points: list[Point]


class RunMetrics(BaseModel):
    run_id: uuid.UUID
    series: list[MetricSeries]


@router.get(
    "",
    operation_id="get_run_metrics",
    response_model=RunMetrics,
    responses=problem_responses(401, 404, 422),
)
async def get_run_metrics(
    request: Request,
    run_id: uuid.UUID,
    caller: Caller,
    name: Annotated[
        list[Annotated[str, Query(max_length=128, pattern=NO_NUL)]] | None,
        Query(max_length=50, description="Only these series."),
    ] = None,
    step_min: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
) -> Response:
    """Per-step metric series of the run (reward mean/std, loss, kl …), by step. Pollers
    should ask for the steps they have not seen (``step_min``)."""
    if step_min is not None and step_max is not None and step_min > step_max:
        raise Problem(
            422,
            "Invalid step range",
            "step_min exceeds step_max.",
            field="query.step_min",
            error_type=INCONSISTENT,
        )
    w = Where([run_id, caller.project_id, MAX_POINTS])
    if name:
        w.among("m.name", name, "text")
    if step_min is not None:
        w.add(f"m.step >= {w.param(step_min)}")
    if step_max is not None:
        w.add(f"m.step <= {w.param(step_max)}")
    async with request.app.state.pg.acquire() as conn:
        row = await conn.fetchrow(_SERIES.format(filters=w.sql()), *w.params)
    if not row["visible"]:
        raise NotFound("Run")
    return Response(
        f'{{"run_id":"{run_id}","series":{row["series"]}}}', media_type="application/json"
    )


# The series as the API shows them, rendered by PostgreSQL: every client of a live run polls
# this, so no ORM and no Python object per point (docs/benchmarks.md, pollers).
_SERIES = """
WITH run AS (
    SELECT id FROM runs WHERE id = $1 AND project_id = $2
), points AS (
    SELECT m.name, m.step, m.value
      FROM metric_points AS m JOIN run ON m.run_id = run.id
     WHERE {filters}
     ORDER BY m.name, m.step
     LIMIT $3
), series AS (
    SELECT name, json_agg(json_build_object('step', step, 'value', value) ORDER BY step) AS points
      FROM points GROUP BY name
)
SELECT EXISTS (SELECT 1 FROM run) AS visible,
       (SELECT coalesce(json_agg(json_build_object('name', name, 'points', points) ORDER BY name),
                        '[]'::json)::text
          FROM series) AS series
"""
