from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import BaseModel
from sqlalchemy import BigInteger, Column, ForeignKey, Identity, Index, Uuid
from sqlmodel import Field, SQLModel

from app.core.columns import timestamp


class MetricPoint(SQLModel, table=True):
    """One value of one metric at one step; unique so a redone step overwrites, not doubles."""

    __tablename__ = "metric_points"
    __table_args__ = (
        Index("uq_metric_points_run_name_step", "run_id", "name", "step", unique=True),
    )

    id: int | None = Field(
        default=None, sa_column=Column(BigInteger, Identity(always=False), primary_key=True)
    )
    run_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    )
    step: int
    name: str = Field(max_length=128)
    value: float
    created_at: datetime | None = Field(default=None, sa_column=timestamp())


class Point(BaseModel):
    step: int
    value: float


class MetricSeries(BaseModel):
    name: str
    points: list[Point]


class RunMetrics(BaseModel):
    """A run's metric series by name, each by step."""

    run_id: uuid.UUID
    series: list[MetricSeries]
