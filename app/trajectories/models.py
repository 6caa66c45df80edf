from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Column, Float, ForeignKey, Index, Uuid
from sqlmodel import Field, SQLModel

from app.core.columns import jsonb, timestamp


class Trajectory(SQLModel, table=True):
    """One rollout (the reference's TrajectoryRecord).

    Unique on (run, step, group, rollout): a step redone after a crash overwrites its rows
    instead of adding a second copy.
    """

    __tablename__ = "trajectories"
    __table_args__ = (
        Index(
            "uq_trajectories_run_step_group_rollout",
            "run_id",
            "step",
            "group_index",
            "rollout_index",
            unique=True,
        ),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    run_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    )
    step: int
    group_index: int
    rollout_index: int
    task_input_id: uuid.UUID | None = Field(
        default=None,
        sa_column=Column(Uuid, ForeignKey("task_inputs.id", ondelete="SET NULL"), nullable=True),
    )
    messages: list[dict[str, Any]] = Field(default_factory=list, sa_column=jsonb(default="[]"))
    reward: float | None = Field(default=None, sa_column=Column(Float, nullable=True))
    reward_breakdown: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    # "metadata" is reserved on SQLAlchemy declarative classes, hence the attribute name.
    meta: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb(name="metadata"))
    created_at: datetime | None = Field(default=None, sa_column=timestamp())
