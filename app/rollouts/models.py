from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Column, ForeignKey, Index, Integer, Text, Uuid, text
from sqlmodel import Field, SQLModel

from app.core.columns import jsonb, timestamp


class GeneratedRollouts(SQLModel, table=True):
    """One step's rollouts, generated ahead by an asynchronous run: the token ids of its
    prompts and completions and the log-probabilities they were sampled with, and the policy
    version (the adapter's step) that sampled them. ``step`` is the step that trains on
    them; ``discarded`` says why a row was not (a resumed run lost its policy version, or it
    fell past the staleness bound). Trained rows of steps up to a checkpoint are deleted with
    it: from there on the trajectories hold what was trained on, policy version included;
    discarded rows stay."""

    __tablename__ = "generated_rollouts"
    __table_args__ = (
        # One usable row per step; discarded ones stay, with the reason.
        Index(
            "uq_generated_rollouts_run_step",
            "run_id",
            "step",
            unique=True,
            postgresql_where=text("discarded IS NULL"),
        ),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    run_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    )
    step: int
    policy_version: int
    rollouts: int = Field(sa_column=Column(Integer, nullable=False))
    payload: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    discarded: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: datetime | None = Field(default=None, sa_column=timestamp())
