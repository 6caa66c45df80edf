"""Request and response shapes of ``/webhooks``. The secret is only on
:class:`WebhookSecret`, the answer of create and rotate: it is shown once."""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.core.pagination import Page
from app.core.storable import HttpUrlStr, RequestModel
from app.webhooks.models import EventType, WebhookDelivery

MAX_URL_CHARS = 2048


class WebhookCreate(RequestModel):
    url: Annotated[HttpUrlStr, Field(max_length=MAX_URL_CHARS)] = Field(
        description="Where events are POSTed: http(s); loopback, private and link-local "
        "targets are refused unless the server allows them."
    )
    event_types: list[EventType] = Field(
        min_length=1,
        max_length=len(EventType),
        description="The events this endpoint receives.",
    )

    @field_validator("event_types")
    @classmethod
    def _once_each(cls, value: list[EventType]) -> list[EventType]:
        # A type named twice still means "this type": keep the first mention of each.
        return list(dict.fromkeys(value))


class WebhookPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    url: str
    event_types: list[EventType]
    created_at: datetime


class WebhookSecret(WebhookPublic):
    secret: str = Field(
        description="The signing secret (`whsec_…`, Standard Webhooks). Shown only now: "
        "store it; rotate the webhook to get a new one."
    )


class WebhooksPage(Page[WebhookPublic]):
    """A page of WebhookPublic, oldest first; pass ``next_cursor`` as ``after``."""


class DeliveryState(StrEnum):
    PENDING = "pending"  # not delivered yet; another attempt is due at next_attempt_at
    DELIVERED = "delivered"  # a 2xx answer was received
    FAILED = "failed"  # every attempt of the retry window failed: given up


class DeliveryPublic(BaseModel):
    id: uuid.UUID = Field(description="The `webhook-id` every attempt of this event sends.")
    webhook_id: uuid.UUID
    event_type: EventType
    state: DeliveryState
    attempts: int
    last_status: int | None = Field(description="HTTP status of the last attempt, if any.")
    last_error: str | None = Field(description="Why the last attempt failed, if it did.")
    created_at: datetime
    next_attempt_at: datetime | None
    delivered_at: datetime | None
    payload: dict[str, Any] = Field(description="The body sent: {type, timestamp, data}.")

    @classmethod
    def of(cls, row: WebhookDelivery) -> DeliveryPublic:
        if row.delivered_at is not None:
            state = DeliveryState.DELIVERED
        elif row.next_attempt_at is None:
            state = DeliveryState.FAILED
        else:
            state = DeliveryState.PENDING
        return cls(
            id=row.id,
            webhook_id=row.webhook_id,
            event_type=EventType(row.event_type),
            state=state,
            attempts=row.attempts,
            last_status=row.last_status,
            last_error=row.last_error,
            created_at=row.created_at,
            next_attempt_at=row.next_attempt_at,
            delivered_at=row.delivered_at,
            payload=row.payload,
        )


class DeliveriesPage(Page[DeliveryPublic]):
    """A page of DeliveryPublic, newest first; pass ``next_cursor`` as ``after``."""
