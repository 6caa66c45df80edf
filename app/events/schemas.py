from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from app.core.pagination import Page


class RunEventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    run_id: uuid.UUID
    type: str
    level: str
    message: str
    data: dict[str, Any]
    created_at: datetime


class RunEventsPage(Page[RunEventPublic]):
    """A page of RunEventPublic; pass ``next_cursor`` as ``after`` for the next."""
