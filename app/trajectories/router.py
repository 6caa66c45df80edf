from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import func, select
from sqlmodel import col

from app.auth.deps import Caller
from app.core.columns import INT32_MAX
from app.core.deps import ReadSession
from app.core.errors import INCONSISTENT, Problem, problem_responses
from app.core.pagination import Paging, cursor_int32, decode_cursor, make_page
from app.runs.service import ensure_run_visible
from app.trajectories.models import Trajectory
from app.trajectories.schemas import TrajectoriesPage, TrajectoryPublic

router = APIRouter(prefix="/runs/{run_id}/trajectories", tags=["trajectories"])


@router.get(
    "",
    operation_id="list_run_trajectories",
    response_model=TrajectoriesPage,
    responses=problem_responses(401, 404, 422),
)
async def list_run_trajectories(
    run_id: uuid.UUID,
    caller: Caller,
    session: ReadSession,
    page: Paging,
    step: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
) -> dict[str, object]:
    """The run's trajectories by (step, group, rollout), optionally filtered by reward."""
    if min_reward is not None and max_reward is not None and min_reward > max_reward:
        raise Problem(
            422,
            "Invalid reward range",
            "min_reward exceeds max_reward.",
            field="query.min_reward",
            error_type=INCONSISTENT,
        )
    await ensure_run_visible(session, caller.project_id, run_id)
    query = select(Trajectory).where(col(Trajectory.run_id) == run_id)
    if step is not None:
        query = query.where(col(Trajectory.step) == step)
    if min_reward is not None:
        query = query.where(col(Trajectory.reward) >= min_reward)
    if max_reward is not None:
        query = query.where(col(Trajectory.reward) <= max_reward)
    order = (col(Trajectory.step), col(Trajectory.group_index), col(Trajectory.rollout_index))
    if page.after:
        position = decode_cursor(page.after, cursor_int32, cursor_int32, cursor_int32)
        query = query.where(func.row(*order) > func.row(*position))
    rows = list((await session.execute(query.order_by(*order).limit(page.limit + 1))).scalars())
    return make_page(
        rows,
        page.limit,
        lambda t: (t.step, t.group_index, t.rollout_index),
        TrajectoryPublic.model_validate,
    )
