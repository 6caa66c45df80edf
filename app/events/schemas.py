from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict


class RunEventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    run_id: uuid.UUID
    type: str
    level: str
    message: str
    data: dict[str, Any]
    created_at: datetime


class RunEventsPage(BaseModel):
    data: list[RunEventPublic]
    has_more: bool
    next_cursor: str | None = None
