from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlmodel import col

from app.auth.deps import Caller
from app.core.deps import ReadSession
from app.core.errors import problem_responses
from app.core.pagination import Page, Paging, cursor_int32, decode_cursor, make_page
from app.inputs.models import TaskInput
from app.runs.service import ensure_run_visible

router = APIRouter(prefix="/runs/{run_id}/inputs", tags=["inputs"])


class TaskInputPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    index: int
    input_text: str
    context: dict[str, Any] | None
    split: str
    created_at: datetime


class TaskInputsPage(Page[TaskInputPublic]):
    """A page of TaskInputPublic; pass ``next_cursor`` as ``after`` for the next."""


@router.get(
    "",
    operation_id="list_run_inputs",
    response_model=TaskInputsPage,
    responses=problem_responses(401, 404, 422),
)
async def list_run_inputs(
    run_id: uuid.UUID,
    caller: Caller,
    session: ReadSession,
    page: Paging,
    split: Annotated[str | None, Query(pattern=r"^(train|validation)$")] = None,
) -> dict[str, object]:
    """The run's training inputs, by index."""
    await ensure_run_visible(session, caller.project_id, run_id)
    query = select(TaskInput).where(col(TaskInput.run_id) == run_id)
    if split is not None:
        query = query.where(col(TaskInput.split) == split)
    if page.after:
        query = query.where(col(TaskInput.index) > decode_cursor(page.after, cursor_int32)[0])
    rows = list(
        (
            await session.execute(query.order_by(col(TaskInput.index)).limit(page.limit + 1))
        ).scalars()
    )
    return make_page(rows, page.limit, lambda t: (t.index,), TaskInputPublic.model_validate)
