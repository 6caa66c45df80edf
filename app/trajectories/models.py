from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Column, Float, ForeignKey, Index, Uuid, text
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
        # Training-data queries (app/training_data): keyset order (created_at, id) under each
        # filter that narrows by an indexed column.
        Index(
            "ix_trajectories_project_created",
            "project_id",
            "created_at",
            "id",
            postgresql_include=["reward"],
        ),
        Index("ix_trajectories_created", "created_at", "id"),
        Index(
            "ix_trajectories_learning_key_created",
            "learning_key",
            "created_at",
            "id",
            postgresql_where=text("learning_key IS NOT NULL"),
        ),
        Index("ix_trajectories_run_created", "run_id", "created_at", "id"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    run_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    )
    # Copied from the run when the row is written (both are fixed at the run's creation).
    project_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    )
    learning_key: str | None = Field(default=None, max_length=200)
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
