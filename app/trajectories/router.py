"""Trajectories over HTTP: a run's rollouts in training order (``/runs/{run_id}/trajectories``)
and the project's training data across runs (``/trajectories``: the training-data library's
filters, queries and keyset order; the export streams JSON Lines as PostgreSQL renders them).
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
from app.core.columns import INT32_MAX, INT64_MAX
from app.core.deps import ReadSession
from app.core.errors import Problem, problem_responses
from app.core.pagination import (
    Paging,
    check_range,
    cursor_int32,
    decode_cursor,
    make_page,
    range_problem,
)
from app.core.storable import NO_NUL
from app.core.time import DayOrInstant
from app.runs.lifecycle.status import RunStatus
from app.runs.service import ensure_run_visible
from app.training_data.filters import (
    MAX_KEY_CHARS,
    EmptyRangeError,
    Filters,
    TrainingDataError,
)
from app.trajectories import service
from app.trajectories.schemas import TrajectoriesPage, TrajectoryPublic

router = APIRouter()

RUN_LIST = "list_run_trajectories"
LIST = "list_trajectories"


@router.get(
    "/runs/{run_id}/trajectories",
    operation_id=RUN_LIST,
    tags=["trajectories"],
    response_model=TrajectoriesPage,
    responses=problem_responses(401, 404, 422),
)
async def list_run_trajectories(
    run_id: uuid.UUID,
    caller: Caller,
    session: ReadSession,
    page: Paging,
    step: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    min_reward: Annotated[float | None, Query(description="Inclusive lower bound.")] = None,
    max_reward: Annotated[float | None, Query(description="Inclusive upper bound.")] = None,
    min_tool_calls: Annotated[
        int | None,
        Query(ge=0, le=INT32_MAX, description="Agent episodes with at least this many tool calls."),
    ] = None,
) -> dict[str, object]:
    """The run's trajectories by (step, group, rollout), optionally filtered by reward and
    by the tool calls of their episodes."""
    check_range("min_reward", min_reward, "max_reward", max_reward)
    scope = (run_id, step, min_reward, max_reward, min_tool_calls)
    after = None
    if page.after:
        step_, group, rollout = decode_cursor(
            page.after, cursor_int32, cursor_int32, cursor_int32, of=RUN_LIST, scope=scope
        )
        after = (step_, group, rollout)
    await ensure_run_visible(session, caller.project_id, run_id)
    rows = await service.list_for_run(
        session,
        run_id,
        step=step,
        min_reward=min_reward,
        max_reward=max_reward,
        min_tool_calls=min_tool_calls,
        after=after,
        limit=page.limit + 1,
    )
    return make_page(
        rows,
        page.limit,
        lambda t: (t.step, t.group_index, t.rollout_index),
        TrajectoryPublic.model_validate,
        of=RUN_LIST,
        scope=scope,
    )


# --- the project's training data ------------------------------------------------------------

_QUERY_NAMES = {
    "run_ids": "run_id",
    "learning_key": "learning_key",
    "statuses": "status",
    "steps": "step",
}

# How many values each list filter takes over HTTP: fewer than the library's 1,000, so that a
# request using every filter to its documented limit fits in a URL the server reads (the
# HTTP parser stops at 64 KiB; tests/api/test_url_limits.py sends the longest one). The
# worst case is 200-character learning keys of 4-byte characters, 2.4 KB each when
# percent-encoded.
MAX_RUN_IDS = 100
MAX_LEARNING_KEYS = 10
MAX_STEPS = 200

# What Filters accepts as a learning key, said in the document too.
LearningKey = Annotated[str, Query(min_length=1, max_length=MAX_KEY_CHARS, pattern=NO_NUL)]


def trajectory_filters(
    caller: Caller,
    min_reward: Annotated[float | None, Query(description="Inclusive lower bound.")] = None,
    max_reward: Annotated[float | None, Query(description="Inclusive upper bound.")] = None,
    run_id: Annotated[
        list[uuid.UUID] | None,
        Query(max_length=MAX_RUN_IDS, description="Repeat for several."),
    ] = None,
    learning_key: Annotated[
        list[LearningKey] | None,
        Query(max_length=MAX_LEARNING_KEYS, description="The runs' grouping key."),
    ] = None,
    status: Annotated[
        list[RunStatus] | None,
        Query(max_length=len(RunStatus), description="The run's current status."),
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
        Query(max_length=MAX_STEPS),
    ] = None,
    min_tool_calls: Annotated[
        int | None,
        Query(
            ge=0,
            le=INT32_MAX,
            description="Agent episodes that made at least this many tool calls "
            "(metadata.tool_calls; a row without it made none).",
        ),
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
            min_tool_calls=min_tool_calls,
        )
    except EmptyRangeError as exc:
        raise range_problem(f"query.{exc.field}", exc.message) from exc
    except TrainingDataError as exc:
        raise Problem(
            422,
            "Invalid filter",
            exc.message,
            field=f"query.{_QUERY_NAMES.get(exc.field, exc.field)}",
            error_type="value_error",
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
    "/trajectories",
    operation_id=LIST,
    tags=["training data"],
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
    # The filters and the order place the keyset; what is included does not.
    scope = (filters, order)
    after = None
    if page.after:
        created, id_ = decode_cursor(
            page.after, datetime.fromisoformat, uuid.UUID, of=LIST, scope=scope
        )
        after = (created, id_)
    rows = await service.page(
        request.app.state.pg,
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
        of=LIST,
        scope=scope,
    )


class TrajectoryCount(BaseModel):
    count: int


@router.get(
    "/trajectories/count",
    operation_id="count_trajectories",
    tags=["training data"],
    response_model=TrajectoryCount,
    responses=problem_responses(401, 422),
)
async def count_trajectories(request: Request, filters: TrajectoryQuery) -> TrajectoryCount:
    """How many of the project's trajectories match the filters."""
    return TrajectoryCount(count=await service.count(request.app.state.pg, filters))


@router.get(
    "/trajectories/export",
    operation_id="export_trajectories",
    tags=["training data"],
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {
                "application/x-ndjson": {
                    # JSON Lines: text whose every line is one TrajectoryPublic (x-line-schema).
                    "schema": {"type": "string", "contentMediaType": "application/x-ndjson"},
                    "x-line-schema": {"$ref": "#/components/schemas/TrajectoryPublic"},
                }
            },
            "description": "One trajectory per line, as `GET /trajectories/{id}` shows it "
            "(a TrajectoryPublic of JSON per line: `x-line-schema`).",
            "headers": {
                "Content-Disposition": {
                    "description": '`attachment; filename="trajectories.jsonl"`',
                    "schema": {"type": "string"},
                }
            },
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
    limit: Annotated[
        int | None, Query(ge=1, le=INT64_MAX, description="At most this many lines.")
    ] = None,
) -> StreamingResponse:
    """Every matching trajectory as JSON Lines, streamed as it is read (never built in
    memory); each batch is one keyset query, so an export holds no transaction open."""
    lines: AsyncIterator[str] = service.jsonl(
        request.app.state.pg,
        filters,
        include_messages=include_messages,
        include_metadata=include_metadata,
        order=order,
        limit=limit,
    )
    return StreamingResponse(
        lines,
        media_type="application/x-ndjson",
        headers={"Content-Disposition": 'attachment; filename="trajectories.jsonl"'},
    )


@router.get(
    "/trajectories/{trajectory_id}",
    operation_id="get_trajectory",
    tags=["training data"],
    response_model=TrajectoryPublic,
    responses=problem_responses(401, 404, 422),
)
async def get_trajectory(
    request: Request, trajectory_id: uuid.UUID, caller: Caller
) -> TrajectoryPublic:
    row = await service.get(request.app.state.pg, caller.project_id, trajectory_id)
    if row is None:
        raise Problem(404, "Not Found", f"Trajectory {trajectory_id} not found.")
    return TrajectoryPublic.model_validate(row)
