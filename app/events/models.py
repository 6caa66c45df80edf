"""Run events: the append-only log behind ``/events`` and the SSE stream.

``id`` is a bigserial, so it orders events of all runs; readers page by it and SSE clients
resume from it (``Last-Event-ID``). Rows are inserted only by :mod:`app.events.service`,
which holds the run's row lock for each, so a run's ids become visible in order.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Column, ForeignKey, Identity, Index, Text, Uuid
from sqlmodel import Field, SQLModel

from app.core.columns import jsonb, timestamp


class RunEvent(SQLModel, table=True):
    __tablename__ = "run_events"
    __table_args__ = (Index("ix_run_events_run_id", "run_id", "id"),)

    id: int | None = Field(
        default=None, sa_column=Column(BigInteger, Identity(always=False), primary_key=True)
    )
    run_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    )
    type: str = Field(max_length=64)
    level: str = Field(default="info", max_length=16)
    message: str = Field(sa_column=Column(Text, nullable=False))
    data: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    created_at: datetime | None = Field(default=None, sa_column=timestamp())
