from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict

from app.auth.deps import Caller
from app.core.deps import ReadSession
from app.core.errors import problem_responses
from app.core.pagination import Page, Paging, cursor_int32, decode_cursor, make_page
from app.inputs import service
from app.runs.service import ensure_run_visible

router = APIRouter(prefix="/runs/{run_id}/inputs", tags=["inputs"])


class TaskInputPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    index: int
    input_text: str
    context: dict[str, Any] | None
    split: Literal["train", "validation"]
    created_at: datetime


class TaskInputsPage(Page[TaskInputPublic]):
    """A page of TaskInputPublic; pass ``next_cursor`` as ``after`` for the next."""


LIST = "list_run_inputs"


@router.get(
    "",
    operation_id=LIST,
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
    scope = (run_id, split)
    after = decode_cursor(page.after, cursor_int32, of=LIST, scope=scope)[0] if page.after else None
    await ensure_run_visible(session, caller.project_id, run_id)
    rows = await service.list_after(
        session, run_id, split=split, after_index=after, limit=page.limit + 1
    )
    return make_page(
        rows, page.limit, lambda t: (t.index,), TaskInputPublic.model_validate, of=LIST, scope=scope
    )
