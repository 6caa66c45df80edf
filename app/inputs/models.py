from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Column, ForeignKey, Index, Text, Uuid
from sqlmodel import Field, SQLModel

from app.core.columns import jsonb, timestamp


class TaskInput(SQLModel, table=True):
    """One training input of a run (the reference's TaskInput), numbered by ``index``."""

    __tablename__ = "task_inputs"
    __table_args__ = (Index("uq_task_inputs_run_index", "run_id", "index", unique=True),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    run_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    )
    index: int
    input_text: str = Field(sa_column=Column(Text, nullable=False))
    context: dict[str, Any] | None = Field(
        default=None, sa_column=jsonb(nullable=True, default=None)
    )
    split: str = Field(default="train", max_length=16)
    created_at: datetime | None = Field(default=None, sa_column=timestamp())
