"""``/trajectories``: the training-data library over HTTP, scoped to the caller's project.

The same filters, the same queries (``app.training_data.queries``), the same keyset order;
the export streams JSON Lines batch by batch as PostgreSQL renders them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from app.auth.deps import Caller
from app.core.columns import INT32_MAX
from app.core.errors import INCONSISTENT, Problem, problem_responses
from app.core.pagination import Paging, decode_cursor, make_page
from app.core.storable import NO_NUL
from app.core.time import DayOrInstant
from app.runs.status import RunStatus
from app.training_data import queries
from app.training_data.filters import (
    MAX_KEY_CHARS,
    MAX_LIST_VALUES,
    EmptyRangeError,
    Filters,
    Order,
    TrainingDataError,
)
from app.trajectories.schemas import TrajectoriesPage, TrajectoryPublic

router = APIRouter(prefix="/trajectories", tags=["training data"])

_QUERY_NAMES = {
    "run_ids": "run_id",
    "learning_key": "learning_key",
    "statuses": "status",
    "steps": "step",
}


# What Filters accepts as a learning key, said in the document too.
LearningKey = Annotated[str, Query(min_length=1, max_length=MAX_KEY_CHARS, pattern=NO_NUL)]


def trajectory_filters(
    caller: Caller,
    min_reward: Annotated[float | None, Query(description="Inclusive lower bound.")] = None,
    max_reward: Annotated[float | None, Query(description="Inclusive upper bound.")] = None,
    run_id: Annotated[
        list[uuid.UUID] | None,
        Query(max_length=MAX_LIST_VALUES, description="Repeat for several."),
    ] = None,
    learning_key: Annotated[
        list[LearningKey] | None,
        Query(max_length=MAX_LIST_VALUES, description="The runs' grouping key."),
    ] = None,
    status: Annotated[
        list[RunStatus] | None,
        Query(max_length=MAX_LIST_VALUES, description="The run's current status."),
    ] = None,
    start_date: Annotated[
        DayOrInstant | None,
        Query(description="Written at or after (ISO 8601; UTC if no zone; a date: its start)."),
    ] = None,
    end_date: Annotated[
        DayOrInstant | None,
        Query(description="Written at or before (ISO 8601; UTC if no zone; a date: its end)."),
    ] = None,
    step: Annotated[
        list[Annotated[int, Query(ge=0, le=INT32_MAX)]] | None,
        Query(max_length=MAX_LIST_VALUES),
    ] = None,
) -> Filters:
    try:
        return Filters.build(
            min_reward=min_reward,
            max_reward=max_reward,
            project_ids=[caller.project_id],
            run_ids=run_id,
            learning_key=learning_key,
            statuses=status,
            start_date=start_date,
            end_date=end_date,
            steps=step,
        )
    except TrainingDataError as exc:
        raise Problem(
            422,
            "Invalid filter",
            exc.message,
            field=f"query.{_QUERY_NAMES.get(exc.field, exc.field)}",
            error_type=INCONSISTENT if isinstance(exc, EmptyRangeError) else None,
        ) from exc


TrajectoryQuery = Annotated[Filters, Depends(trajectory_filters)]
IncludeMessages = Annotated[
    bool, Query(description="false leaves out the messages (most of a row's bytes).")
]
IncludeMetadata = Annotated[
    bool, Query(description="false leaves out reward_breakdown and metadata.")
]
OrderQuery = Annotated[Literal["newest", "oldest"], Query(description="By creation time, then id.")]


@router.get(
    "",
    operation_id="list_trajectories",
    response_model=TrajectoriesPage,
    responses=problem_responses(401, 422),
)
async def list_trajectories(
    request: Request,
    filters: TrajectoryQuery,
    page: Paging,
    include_messages: IncludeMessages = True,
    include_metadata: IncludeMetadata = True,
    order: OrderQuery = "newest",
) -> dict[str, Any]:
    """The project's trajectories matching every filter given, newest first."""
    after = None
    if page.after:
        created, id_ = decode_cursor(page.after, datetime.fromisoformat, uuid.UUID)
        after = (created, id_)
    async with request.app.state.pg.acquire() as conn:
        rows = await queries.fetch_trajectories(
            conn,
            filters,
            include_messages=include_messages,
            include_metadata=include_metadata,
            order=order,
            after=after,
            limit=page.limit + 1,
        )
    return make_page(
        rows,
        page.limit,
        lambda t: (t.created_at.isoformat(), t.id),
        TrajectoryPublic.model_validate,
    )


class TrajectoryCount(BaseModel):
    count: int


@router.get(
    "/count",
    operation_id="count_trajectories",
    response_model=TrajectoryCount,
    responses=problem_responses(401, 422),
)
async def count_trajectories(request: Request, filters: TrajectoryQuery) -> TrajectoryCount:
    """How many of the project's trajectories match the filters."""
    async with request.app.state.pg.acquire() as conn:
        return TrajectoryCount(count=await queries.count_trajectories(conn, filters))


@router.get(
    "/export",
    operation_id="export_trajectories",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/x-ndjson": {}},
            "description": "One trajectory per line, as `GET /trajectories/{id}` shows it.",
        },
        **problem_responses(401, 422),
    },
)
async def export_trajectories(
    request: Request,
    filters: TrajectoryQuery,
    format: Annotated[Literal["jsonl"], Query(description="Only JSON Lines, for now.")] = "jsonl",
    include_messages: IncludeMessages = True,
    include_metadata: IncludeMetadata = True,
    order: OrderQuery = "newest",
    limit: Annotated[int | None, Query(ge=1, description="At most this many lines.")] = None,
) -> StreamingResponse:
    """Every matching trajectory as JSON Lines, streamed as it is read (never built in
    memory); each batch is one keyset query, so an export holds no transaction open."""
    pool = request.app.state.pg

    async def lines(order: Order) -> AsyncIterator[str]:
        async with pool.acquire() as conn:
            async for chunk in queries.jsonl_chunks(
                conn,
                filters,
                include_messages=include_messages,
                include_metadata=include_metadata,
                order=order,
                limit=limit,
            ):
                yield chunk

    return StreamingResponse(
        lines(order),
        media_type="application/x-ndjson",
        headers={"Content-Disposition": 'attachment; filename="trajectories.jsonl"'},
    )


@router.get(
    "/{trajectory_id}",
    operation_id="get_trajectory",
    response_model=TrajectoryPublic,
    responses=problem_responses(401, 404, 422),
)
async def get_trajectory(
    request: Request, trajectory_id: uuid.UUID, caller: Caller
) -> TrajectoryPublic:
    async with request.app.state.pg.acquire() as conn:
        row = await queries.fetch_trajectory(conn, trajectory_id, project_ids=[caller.project_id])
    if row is None:
        raise Problem(404, "Not Found", f"Trajectory {trajectory_id} not found.")
    return TrajectoryPublic.model_validate(row)
