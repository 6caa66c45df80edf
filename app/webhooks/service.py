"""Webhook use cases: what the routes call. Nothing here commits (the request session
does, at the edge)."""

from __future__ import annotations

import base64
import secrets
import uuid
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from app.core.domain import InvalidInput, LimitReached, NotFound
from app.core.errors import UNUSABLE_TARGET
from app.webhooks import repository
from app.webhooks.models import Webhook, WebhookDelivery
from app.webhooks.schemas import WebhookCreate
from app.webhooks.targets import refusal

#: A project's endpoints at most: each event is one row and one request per endpoint.
MAX_WEBHOOKS_PER_PROJECT = 20

#: Standard Webhooks secrets are 24 to 64 random bytes, base64, prefixed ``whsec_``.
_SECRET_BYTES = 32


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(_SECRET_BYTES)).decode()


async def create(
    session: AsyncSession, project_id: uuid.UUID, body: WebhookCreate, *, allow_private: bool
) -> Webhook:
    """A new endpoint with a fresh secret (the answer's only copy of it)."""
    why = await refusal(body.url, allow_private=allow_private)
    if why is not None:
        raise InvalidInput(f"url {why}.", field="body.url", error_type=UNUSABLE_TARGET)
    await repository.lock_project(session, project_id)
    if await repository.count(session, project_id) >= MAX_WEBHOOKS_PER_PROJECT:
        raise LimitReached(
            f"A project may have at most {MAX_WEBHOOKS_PER_PROJECT} webhooks; delete one first.",
            limit=MAX_WEBHOOKS_PER_PROJECT,
        )
    return await repository.insert(
        session, project_id, body.url, [t.value for t in body.event_types], new_secret()
    )


async def list_after(
    session: AsyncSession,
    project_id: uuid.UUID,
    *,
    after: tuple[datetime, uuid.UUID] | None,
    limit: int,
) -> list[Webhook]:
    return await repository.list_after(session, project_id, after=after, limit=limit)


async def delete(session: AsyncSession, project_id: uuid.UUID, webhook_id: uuid.UUID) -> None:
    if not await repository.remove(session, project_id, webhook_id):
        raise NotFound("Webhook")


async def rotate(session: AsyncSession, project_id: uuid.UUID, webhook_id: uuid.UUID) -> Webhook:
    """Replace the secret. Deliveries are signed when sent, so every attempt from now on,
    retries of older events included, carries the new one."""
    webhook = await repository.set_secret(session, project_id, webhook_id, new_secret())
    if webhook is None:
        raise NotFound("Webhook")
    return webhook


async def deliveries(
    session: AsyncSession,
    project_id: uuid.UUID,
    webhook_id: uuid.UUID,
    *,
    before: tuple[datetime, uuid.UUID] | None,
    limit: int,
) -> list[WebhookDelivery]:
    if await repository.get(session, project_id, webhook_id) is None:
        raise NotFound("Webhook")
    return await repository.deliveries(session, webhook_id, before=before, limit=limit)
