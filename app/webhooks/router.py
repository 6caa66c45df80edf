"""``/webhooks``: a project's endpoints for run and checkpoint events (docs/webhooks.md).

Every route here is an admin key's (app/auth/roles.py), the reads too: a target URL is often
a credential itself (a chat service's incoming-webhook URL carries its token), and the
deliveries show what was sent where and what the receiver answered."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request, Response

from app.auth.deps import Admin
from app.core.deps import ReadSession, Session
from app.core.errors import problem_responses
from app.core.pagination import Paging, decode_cursor, make_page
from app.core.settings import app_settings
from app.webhooks import service
from app.webhooks.schemas import (
    DeliveriesPage,
    DeliveryPublic,
    WebhookCreate,
    WebhookPublic,
    WebhookSecret,
    WebhooksPage,
)

router = APIRouter(prefix="/webhooks", tags=["webhooks"])


def _key(row: Any) -> tuple[str, str]:
    """The cursor of a row of either list: both are ordered by (created_at, id)."""
    return (row.created_at.isoformat(), str(row.id))


def _position(
    cursor: str | None, *, of: str, scope: tuple[Any, ...]
) -> tuple[datetime, uuid.UUID] | None:
    if not cursor:
        return None
    created_at, row_id = decode_cursor(
        cursor, datetime.fromisoformat, uuid.UUID, of=of, scope=scope
    )
    return (created_at, row_id)


@router.post(
    "",
    status_code=201,
    operation_id="create_webhook",
    response_model=WebhookSecret,
    responses=problem_responses(401, 403, 422, 429),
)
async def create_webhook(
    body: WebhookCreate, request: Request, caller: Admin, session: Session
) -> WebhookSecret:
    """Register an endpoint. The answer holds its signing secret, shown only this once."""
    allow_private = app_settings(request).webhooks_allow_private
    webhook = await service.create(session, caller.project_id, body, allow_private=allow_private)
    return WebhookSecret.model_validate(webhook)


LIST = "list_webhooks"


@router.get(
    "",
    operation_id=LIST,
    response_model=WebhooksPage,
    responses=problem_responses(401, 403, 422),
)
async def list_webhooks(caller: Admin, session: ReadSession, page: Paging) -> dict[str, Any]:
    """The project's endpoints, oldest first. Their secrets are never shown again."""
    after = _position(page.after, of=LIST, scope=())
    rows = await service.list_after(session, caller.project_id, after=after, limit=page.limit + 1)
    return make_page(rows, page.limit, _key, WebhookPublic.model_validate, of=LIST)


@router.delete(
    "/{webhook_id}",
    status_code=204,
    operation_id="delete_webhook",
    responses=problem_responses(401, 403, 404, 422),
)
async def delete_webhook(webhook_id: uuid.UUID, caller: Admin, session: Session) -> Response:
    """Remove the endpoint; its pending deliveries are dropped with it."""
    await service.delete(session, caller.project_id, webhook_id)
    return Response(status_code=204)


@router.post(
    "/{webhook_id}/rotate",
    operation_id="rotate_webhook_secret",
    response_model=WebhookSecret,
    responses=problem_responses(401, 403, 404, 422),
)
async def rotate_webhook_secret(
    webhook_id: uuid.UUID, caller: Admin, session: Session
) -> WebhookSecret:
    """A new signing secret, shown only in this answer; the old one stops signing now."""
    webhook = await service.rotate(session, caller.project_id, webhook_id)
    return WebhookSecret.model_validate(webhook)


DELIVERIES = "list_webhook_deliveries"


@router.get(
    "/{webhook_id}/deliveries",
    operation_id=DELIVERIES,
    response_model=DeliveriesPage,
    responses=problem_responses(401, 403, 404, 422),
)
async def list_webhook_deliveries(
    webhook_id: uuid.UUID, caller: Admin, session: ReadSession, page: Paging
) -> dict[str, Any]:
    """The endpoint's events, newest first: attempts, last status or error, when delivered."""
    scope = (webhook_id,)
    before = _position(page.after, of=DELIVERIES, scope=scope)
    rows = await service.deliveries(
        session, caller.project_id, webhook_id, before=before, limit=page.limit + 1
    )
    return make_page(
        rows,
        page.limit,
        _key,
        DeliveryPublic.of,
        of=DELIVERIES,
        scope=scope,
    )
