"""The ``webhooks`` table (a project's endpoints) and ``webhook_deliveries`` (the outbox).

A delivery row is written by a trigger (migration 0009) in the transaction that writes its
event, one per matching webhook; its ``id`` is the ``webhook-id`` every attempt sends, so a
receiver can deduplicate retries. ``next_attempt_at`` is NULL once the row is settled:
delivered (``delivered_at`` set) or given up (``delivered_at`` still NULL).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import ARRAY, Column, DateTime, ForeignKey, Index, Text, Uuid, text
from sqlmodel import Field, SQLModel

from app.core.columns import jsonb, timestamp


class EventType(StrEnum):
    """What a webhook can subscribe to: a run's status events to these four statuses, and a
    checkpoint recorded (the final model included, ``is_final`` in its data)."""

    RUN_COMPLETED = "run.completed"
    RUN_FAILED = "run.failed"
    RUN_CANCELLED = "run.cancelled"
    RUN_PAUSED = "run.paused"
    CHECKPOINT_SAVED = "checkpoint.saved"


class Webhook(SQLModel, table=True):
    __tablename__ = "webhooks"
    __table_args__ = (Index("ix_webhooks_project_created", "project_id", "created_at", "id"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    project_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    )
    url: str = Field(sa_column=Column(Text, nullable=False))
    event_types: list[str] = Field(sa_column=Column(ARRAY(Text), nullable=False))
    # The signing key (``whsec_…``): stored as it is, since every delivery is signed with it;
    # served only in the answers of create and rotate.
    secret: str = Field(sa_column=Column(Text, nullable=False))
    created_at: datetime | None = Field(default=None, sa_column=timestamp())


class WebhookDelivery(SQLModel, table=True):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # The senders' claim: only rows still to be tried, by when they are due.
        Index(
            "ix_webhook_deliveries_due",
            "next_attempt_at",
            postgresql_where=text("next_attempt_at IS NOT NULL"),
        ),
        # GET /webhooks/{id}/deliveries: newest first.
        Index("ix_webhook_deliveries_webhook_created", "webhook_id", "created_at", "id"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    webhook_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=False)
    )
    event_type: str = Field(max_length=32)
    payload: dict[str, Any] = Field(default_factory=dict, sa_column=jsonb())
    created_at: datetime | None = Field(default=None, sa_column=timestamp())
    next_attempt_at: datetime | None = Field(
        default=None,
        sa_column=Column(DateTime(timezone=True), nullable=True, server_default=text("now()")),
    )
    attempts: int = 0
    last_status: int | None = None
    last_error: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    delivered_at: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )
