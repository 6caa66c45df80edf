"""The gateway's rows: ``episodes`` (one per rollout of a gateway run) and
``episode_calls`` (every model call an episode made, with the engine's own token ids).

An episode is made by the worker when its step starts collecting, handed to a harness by a
claim (``issued`` counts them; the claim's token is stored hashed), and ends ``finished``
(the harness's reward), ``failed`` (the harness said so) or ``dropped`` (given out
``max_issues`` times without an end, or still open when its run ended: cancelled, failed,
completed). A later attempt that redoes its step from an earlier
checkpoint hands it out again (its calls came from weights that no longer exist) under a
new claim; its earlier calls stay, under their issue (the count goes on, and a hand-out of
the lost attempt counts against ``max_issues``).

Token ids and log-probabilities are stored as packed little-endian arrays (int32, float32):
four bytes a token each, not JSON text (docs/gateway.md, storage).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    Index,
    LargeBinary,
    String,
    Text,
    Uuid,
    text,
)
from sqlmodel import Field, SQLModel

from app.core.columns import jsonb, timestamp


class EpisodeStatus(StrEnum):
    pending = "pending"  # waiting for a harness to claim it
    claimed = "claimed"  # a harness holds it until its deadline
    finished = "finished"  # the harness finished it (a reward, or none)
    failed = "failed"  # the harness gave up on it: no reward
    dropped = "dropped"  # handed out max_issues times without an end: no reward

    @property
    def open(self) -> bool:
        return self in (EpisodeStatus.pending, EpisodeStatus.claimed)


_STATUSES = ", ".join(f"'{s.value}'" for s in EpisodeStatus)


class Episode(SQLModel, table=True):
    __tablename__ = "episodes"
    __table_args__ = (
        CheckConstraint(f"status IN ({_STATUSES})", name="ck_episodes_status"),
        CheckConstraint("phase IN ('train', 'eval')", name="ck_episodes_phase"),
        Index("uq_episodes_run_phase_step_slot", "run_id", "phase", "step", "slot", unique=True),
        # Claims take the oldest pending episodes of a run.
        Index(
            "ix_episodes_pending",
            "run_id",
            "created_at",
            postgresql_where=text("status = 'pending'"),
        ),
        Index("ix_episodes_run_created", "run_id", "created_at", "id"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    run_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    )
    phase: str = Field(default="train", sa_column=Column(String(8), nullable=False))
    step: int  # the step whose rollouts it makes (eval: the step it evaluates after)
    slot: int  # its place in the step's batch: group_index * rollouts_per_group + rollout
    group_index: int
    rollout_index: int
    task_input_id: uuid.UUID | None = Field(
        default=None,
        sa_column=Column(Uuid, ForeignKey("task_inputs.id", ondelete="SET NULL"), nullable=True),
    )
    prompt: list[dict[str, Any]] = Field(default_factory=list, sa_column=jsonb(default="[]"))
    context: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    status: EpisodeStatus = Field(
        default=EpisodeStatus.pending, sa_column=Column(String(12), nullable=False)
    )
    # The run's attempt that made it: calls made under another attempt's weights are not
    # this attempt's policy unless they came from the checkpoint both share.
    attempt: int = 0
    issued: int = 0  # how many times a harness claimed it
    max_issues: int = 3
    max_calls: int = 32
    timeout_seconds: float = 300.0
    token_hash: str | None = Field(default=None, max_length=64)  # the current claim's
    claimed_at: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )
    deadline: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )
    reward: float | None = Field(default=None, sa_column=Column(Float, nullable=True))
    metrics: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    messages: list[dict[str, Any]] | None = Field(
        default=None, sa_column=jsonb(nullable=True, default=None)
    )
    error: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: datetime | None = Field(default=None, sa_column=timestamp())
    ended_at: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )


class EpisodeCall(SQLModel, table=True):
    """One chat completion of an episode, as the engine made it."""

    __tablename__ = "episode_calls"
    __table_args__ = (
        Index("uq_episode_calls_episode_issue_seq", "episode_id", "issue", "seq", unique=True),
        Index("ix_episode_calls_run_created", "run_id", "created_at"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    episode_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("episodes.id", ondelete="CASCADE"), nullable=False)
    )
    run_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    )
    issue: int  # the claim of the episode it was made under
    seq: int  # its order within that claim, from 1
    policy_version: int  # the optimizer steps the weights that answered had taken
    request: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    response: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    prompt_ids: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    completion_ids: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    logprobs: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    latency_ms: float = 0.0  # the call as the harness saw it, in the API
    generation_ms: float = 0.0  # the engine's generation that answered it
    queued_ms: float = 0.0  # its wait for the engine (the inbox, generations before it)
    created_at: datetime | None = Field(default=None, sa_column=timestamp())
