"""The ``runs`` table: the reference's TrainingRun plus concurrency and lease columns.

Columns a request may never set (status, project, version, lease, attempt, flags) live only
here, never on the request schemas.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, Column, ForeignKey, Index, String, Text, Uuid, text
from sqlmodel import Field, SQLModel

from app.core.columns import jsonb, timestamp
from app.runs.lifecycle.status import TERMINAL, RunStatus

_STATUSES = ", ".join(f"'{s.value}'" for s in RunStatus)
_TERMINAL = ", ".join(f"'{s.value}'" for s in sorted(TERMINAL))


class Run(SQLModel, table=True):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(f"status IN ({_STATUSES})", name="ck_runs_status"),
        # GET /runs: newest first within a project, optionally by status or model.
        Index("ix_runs_project_created", "project_id", "created_at", "id"),
        Index("ix_runs_project_status_created", "project_id", "status", "created_at", "id"),
        Index("ix_runs_project_model_created", "project_id", "model_name", "created_at", "id"),
        # The reconciler scans only live runs, by when their lease runs out.
        Index(
            "ix_runs_live_lease",
            "lease_expires_at",
            postgresql_where=text(f"status NOT IN ({_TERMINAL})"),
        ),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    project_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    )
    status: RunStatus = Field(
        default=RunStatus.PENDING, sa_column=Column(String(16), nullable=False)
    )
    model_name: str = Field(max_length=500)
    trained_model_name: str | None = Field(default=None, max_length=500)
    task_description: str = Field(sa_column=Column(Text, nullable=False))
    num_examples: int = 100
    rollouts_per_group: int = 4
    learning_rate: float = 1e-5
    num_epochs: int = 1
    max_steps: int | None = None
    system_prompt: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    learning_key: str | None = Field(default=None, max_length=200, index=True)
    reward: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    grpo: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    config: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    # The LLM that writes the run's inputs from task_description (None: the workers' default).
    generator: dict[str, Any] | None = Field(
        default=None, sa_column=jsonb(nullable=True, default=None)
    )
    # Where an agent acts (app.runs.spec.environments) and its supervised warm-up
    # (app.runs.spec.sft), as validated; None: a single-turn run without tools, no warm-up.
    environment: dict[str, Any] | None = Field(
        default=None, sa_column=jsonb(nullable=True, default=None)
    )
    sft: dict[str, Any] | None = Field(default=None, sa_column=jsonb(nullable=True, default=None))
    # A teacher run's settings (app.runs.spec.teacher), as validated; None: plain GRPO.
    teacher: dict[str, Any] | None = Field(
        default=None, sa_column=jsonb(nullable=True, default=None)
    )
    metrics: dict[str, Any] | None = Field(
        default=None, sa_column=jsonb(nullable=True, default=None)
    )
    error: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    # The uploaded dataset the run's inputs were copied from (they live on in task_inputs).
    dataset_id: uuid.UUID | None = Field(
        default=None,
        sa_column=Column(Uuid, ForeignKey("datasets.id", ondelete="SET NULL"), nullable=True),
    )

    # The run whose checkpoint this one started from (POST /runs with from_checkpoint).
    parent_run_id: uuid.UUID | None = Field(
        default=None,
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="SET NULL"), nullable=True),
    )
    parent_step: int | None = None

    created_at: datetime | None = Field(default=None, sa_column=timestamp())
    updated_at: datetime | None = Field(default=None, sa_column=timestamp())
    started_at: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )
    completed_at: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )

    step: int = 0
    epoch: int = 0
    # Bumped by PostgreSQL on every change a client can see (status, flags, progress): the
    # compare-and-set token and the ETag. Lease bookkeeping (renew, release, dispatch)
    # leaves it alone. Never written by the application (trigger runs_count_change, 0006).
    version: int = 1
    # Lease: which worker holds the run until when; attempt is the fencing token.
    lease_owner: str | None = Field(default=None, max_length=200)
    lease_expires_at: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )
    attempt: int = 0
    # Leases that ran out without being given back (crashes, partitions): what the cap on
    # attempts counts. Pauses, resumes and handovers are claims, not failures.
    failures: int = 0
    # When a task for this run was last published; the reconciler re-publishes after a while.
    dispatched_at: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )
    cancel_requested: bool = False
    pause_requested: bool = False
