from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from app.auth.deps import Caller
from app.checkpoints import service
from app.core.deps import ReadSession
from app.core.errors import problem_responses
from app.core.pagination import Page, Paging, cursor_int32, decode_cursor, make_page
from app.runs.service import ensure_run_visible

router = APIRouter(prefix="/runs/{run_id}/checkpoints", tags=["checkpoints"])


class CheckpointPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    run_id: uuid.UUID
    step: int
    path: str
    is_final: bool
    metrics: dict[str, Any]
    created_at: datetime


class CheckpointsPage(Page[CheckpointPublic]):
    """A page of CheckpointPublic; pass ``next_cursor`` as ``after`` for the next."""


LIST = "list_run_checkpoints"


@router.get(
    "",
    operation_id=LIST,
    response_model=CheckpointsPage,
    responses=problem_responses(401, 404, 422),
)
async def list_run_checkpoints(
    run_id: uuid.UUID, caller: Caller, session: ReadSession, page: Paging
) -> dict[str, object]:
    """Complete checkpoints of the run, by step; the final model is marked `is_final`."""
    scope = (run_id,)
    after = decode_cursor(page.after, cursor_int32, of=LIST, scope=scope)[0] if page.after else None
    await ensure_run_visible(session, caller.project_id, run_id)
    rows = await service.list_after(session, run_id, after_step=after, limit=page.limit + 1)
    return make_page(
        rows, page.limit, lambda c: (c.step,), CheckpointPublic.model_validate, of=LIST, scope=scope
    )
