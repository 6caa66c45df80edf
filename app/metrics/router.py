from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel
from sqlalchemy import select
from sqlmodel import col

from app.auth.deps import Caller
from app.core.columns import INT32_MAX
from app.core.deps import ReadSession
from app.core.errors import INCONSISTENT, Problem, problem_responses
from app.core.storable import NO_NUL
from app.metrics.models import MetricPoint
from app.runs.service import ensure_run_visible

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
    run_id: uuid.UUID,
    caller: Caller,
    session: ReadSession,
    name: Annotated[
        list[Annotated[str, Query(max_length=128, pattern=NO_NUL)]] | None,
        Query(max_length=50, description="Only these series."),
    ] = None,
    step_min: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
) -> RunMetrics:
    """Per-step metric series of the run (reward mean/std, loss, kl …), by step."""
    if step_min is not None and step_max is not None and step_min > step_max:
        raise Problem(
            422,
            "Invalid step range",
            "step_min exceeds step_max.",
            field="query.step_min",
            error_type=INCONSISTENT,
        )
    await ensure_run_visible(session, caller.project_id, run_id)
    query = select(col(MetricPoint.name), col(MetricPoint.step), col(MetricPoint.value)).where(
        col(MetricPoint.run_id) == run_id
    )
    if name:
        query = query.where(col(MetricPoint.name).in_(name))
    if step_min is not None:
        query = query.where(col(MetricPoint.step) >= step_min)
    if step_max is not None:
        query = query.where(col(MetricPoint.step) <= step_max)
    query = query.order_by(col(MetricPoint.name), col(MetricPoint.step)).limit(MAX_POINTS)
    series: dict[str, list[Point]] = {}
    for row in await session.execute(query):
        series.setdefault(row.name, []).append(Point(step=row.step, value=row.value))
    return RunMetrics(
        run_id=run_id, series=[MetricSeries(name=n, points=p) for n, p in series.items()]
    )
