"""The SQL of webhooks: a project's endpoints, and the outbox's claim and settlement.

Every read of an endpoint is scoped to the caller's project, so another project's webhook
is simply not found. The outbox is drained with a claim that takes due rows with
``FOR UPDATE SKIP LOCKED`` and pushes their ``next_attempt_at`` past the attempt's timeout
in the same statement, committed before anything is sent: several senders never take one
row at once, no transaction stays open across an HTTP request, and a sender that dies
mid-attempt leaves the row due again once that lease runs out.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, text, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col

from app.auth.models import Project
from app.webhooks.models import Webhook, WebhookDelivery


async def lock_project(session: AsyncSession, project_id: uuid.UUID) -> None:
    """Queue this transaction behind any other changing the project's webhooks, so a
    count taken next stays true until commit."""
    await session.execute(
        select(col(Project.id)).where(col(Project.id) == project_id).with_for_update()
    )


async def count(session: AsyncSession, project_id: uuid.UUID) -> int:
    return int(
        await session.scalar(
            select(func.count()).select_from(Webhook).where(col(Webhook.project_id) == project_id)
        )
        or 0
    )


async def insert(
    session: AsyncSession, project_id: uuid.UUID, url: str, event_types: list[str], secret: str
) -> Webhook:
    webhook = Webhook(project_id=project_id, url=url, event_types=event_types, secret=secret)
    session.add(webhook)
    await session.flush()
    await session.refresh(webhook)  # created_at, from the database
    return webhook


async def list_after(
    session: AsyncSession,
    project_id: uuid.UUID,
    *,
    after: tuple[datetime, uuid.UUID] | None,
    limit: int,
) -> list[Webhook]:
    """The project's webhooks, oldest first, after keyset position ``after``."""
    query = select(Webhook).where(col(Webhook.project_id) == project_id)
    if after is not None:
        query = query.where(tuple_(col(Webhook.created_at), col(Webhook.id)) > tuple_(*after))
    query = query.order_by(col(Webhook.created_at), col(Webhook.id)).limit(limit)
    return list((await session.execute(query)).scalars())


async def get(
    session: AsyncSession, project_id: uuid.UUID, webhook_id: uuid.UUID
) -> Webhook | None:
    query = select(Webhook).where(
        col(Webhook.id) == webhook_id, col(Webhook.project_id) == project_id
    )
    return (await session.execute(query)).scalar_one_or_none()


async def remove(session: AsyncSession, project_id: uuid.UUID, webhook_id: uuid.UUID) -> bool:
    """Delete the webhook and (cascading) its outbox rows: nothing more is sent to it."""
    result = await session.execute(
        delete(Webhook)
        .where(col(Webhook.id) == webhook_id, col(Webhook.project_id) == project_id)
        .returning(col(Webhook.id))
    )
    return result.first() is not None


async def set_secret(
    session: AsyncSession, project_id: uuid.UUID, webhook_id: uuid.UUID, secret: str
) -> Webhook | None:
    result = await session.execute(
        update(Webhook)
        .where(col(Webhook.id) == webhook_id, col(Webhook.project_id) == project_id)
        .values(secret=secret)
        .returning(Webhook)
    )
    return result.scalar_one_or_none()


async def deliveries(
    session: AsyncSession,
    webhook_id: uuid.UUID,
    *,
    before: tuple[datetime, uuid.UUID] | None,
    limit: int,
) -> list[WebhookDelivery]:
    """The webhook's outbox rows, newest first, after keyset position ``before``."""
    query = select(WebhookDelivery).where(col(WebhookDelivery.webhook_id) == webhook_id)
    if before is not None:
        query = query.where(
            tuple_(col(WebhookDelivery.created_at), col(WebhookDelivery.id)) < tuple_(*before)
        )
    query = query.order_by(
        col(WebhookDelivery.created_at).desc(), col(WebhookDelivery.id).desc()
    ).limit(limit)
    return list((await session.execute(query)).scalars())


# --- the outbox -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Claimed:
    """One attempt a sender now owns: ``attempt`` fences the row's settlement."""

    id: uuid.UUID
    attempt: int
    created_at: datetime
    payload: dict[str, Any]
    url: str
    secret: str


_CLAIM = text(
    """
    WITH due AS (
        SELECT id FROM webhook_deliveries
         WHERE next_attempt_at <= now()
         ORDER BY next_attempt_at
         LIMIT :batch
           FOR UPDATE SKIP LOCKED
    )
    UPDATE webhook_deliveries AS d
       SET attempts = d.attempts + 1,
           next_attempt_at = now() + make_interval(secs => :lease)
      FROM due, webhooks AS w
     WHERE d.id = due.id AND w.id = d.webhook_id
    RETURNING d.id, d.attempts, d.created_at, d.payload, w.url, w.secret
    """
)


async def claim(session: AsyncSession, *, batch: int, lease_seconds: float) -> list[Claimed]:
    """Take up to ``batch`` due rows for ``lease_seconds``; commit before sending."""
    rows = await session.execute(_CLAIM, {"batch": batch, "lease": lease_seconds})
    return [Claimed(*row) for row in rows]


_SETTLE = text(
    """
    UPDATE webhook_deliveries
       SET last_status = :status,
           last_error = :error,
           delivered_at = CASE WHEN :delivered THEN now() END,
           next_attempt_at = CASE
               WHEN :delivered THEN NULL
               WHEN now() >= created_at + make_interval(secs => :window) THEN NULL
               ELSE least(now() + make_interval(secs => :delay),
                          created_at + make_interval(secs => :window))
           END
     WHERE id = :id AND attempts = :attempt AND delivered_at IS NULL
    """
)


async def settle(
    session: AsyncSession,
    claimed: Claimed,
    *,
    status: int | None,
    error: str | None,
    delivered: bool,
    delay_seconds: float,
    window_seconds: float,
) -> None:
    """Record an attempt's outcome: delivered, or due again after ``delay_seconds`` (never
    past the retry window's end, the last attempt being at that end), or, once the window
    is over, given up. Only the attempt that claimed the row may settle it."""
    await session.execute(
        _SETTLE,
        {
            "id": claimed.id,
            "attempt": claimed.attempt,
            "status": status,
            "error": error,
            "delivered": delivered,
            "delay": delay_seconds,
            "window": window_seconds,
        },
    )
