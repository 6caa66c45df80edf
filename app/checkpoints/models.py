from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Column, ForeignKey, Index, Text, Uuid
from sqlmodel import Field, SQLModel

from app.core.columns import jsonb, timestamp


class Checkpoint(SQLModel, table=True):
    """A complete checkpoint on disk: recorded only after its folder was renamed into place."""

    __tablename__ = "checkpoints"
    # The final model may share its step with the last resumable checkpoint.
    __table_args__ = (
        Index("uq_checkpoints_run_step_final", "run_id", "step", "is_final", unique=True),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    run_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    )
    step: int
    path: str = Field(sa_column=Column(Text, nullable=False))
    is_final: bool = False
    metrics: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    created_at: datetime | None = Field(default=None, sa_column=timestamp())
