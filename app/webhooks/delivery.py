"""Sending the outbox: Standard Webhooks requests, retried with backoff for a day.

:func:`deliver_due` is one pass of a sender. It claims due rows (committed first, see
:mod:`app.webhooks.repository`), POSTs each event's JSON body to its webhook with the
``webhook-id`` (the row's id: the same on every attempt, so receivers deduplicate),
``webhook-timestamp`` and ``webhook-signature`` headers the ``standardwebhooks`` package
signs, and records the outcome. A 2xx answer delivers; anything else — another status, a
redirect (never followed: a public target must not bounce a request inward), a refused
connection, a timeout, a target that now resolves to a private address — is retried after
an exponential delay with full jitter (uniform in ``[0, min(max_delay, base · 2^(n-1))]``)
until ``webhook_retry_hours`` after the event, when the last attempt is made and the row is
given up.

Requests go through :class:`app.webhooks.transport.WebhookTransport`: each connection
resolves the host once, checks every address it got (unless ``webhooks_allow_private``) and
connects to one of them, so what was checked is what is reached.

Delivery is at least once: a sender that dies between the receiver's 2xx and recording it
sends the event again, with the same ``webhook-id``, once the claim's lease runs out.

The workers run a pass from their maintenance loop (workers/maintenance.py), woken by the
triggers' ``pg_notify`` on :data:`CHANNEL`; several processes may run passes at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass

import httpcore
import httpx
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from standardwebhooks import Webhook

from app.core.db import session_scope
from app.core.settings import Settings
from app.core.time import utcnow
from app.webhooks import repository
from app.webhooks.repository import Claimed
from app.webhooks.targets import Refused, Resolve, resolve
from app.webhooks.transport import WebhookTransport

log = logging.getLogger(__name__)

#: What the outbox triggers notify (migration 0009) and the senders listen on.
CHANNEL = "trainyard_webhooks_due"
#: Rows one pass claims at most; their requests run concurrently.
BATCH = 50
#: A claim outlives the attempt's timeout by this much before another sender may retry it.
LEASE_MARGIN_SECONDS = 30.0
#: Longest error text kept on a row.
MAX_ERROR_CHARS = 500
USER_AGENT = "Trainyard-Webhooks/1"


@dataclass(frozen=True)
class Backoff:
    """Delays between attempts: exponential, with full jitter so that a receiver coming
    back up is not hit by every sender's retries at the same instant."""

    base_seconds: float = 10.0
    max_delay_seconds: float = 3600.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds before the attempt after attempt number ``attempt`` (1 for the first)."""
        ceiling = min(self.max_delay_seconds, self.base_seconds * 2.0 ** min(attempt - 1, 60))
        return rng.uniform(0.0, ceiling)


@dataclass(frozen=True)
class Outcome:
    status: int | None
    error: str | None

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def _error(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


async def _attempt(client: httpx.AsyncClient, claimed: Claimed, *, seconds: float) -> Outcome:
    msg_id = str(claimed.id)
    body = json.dumps(claimed.payload, separators=(",", ":"), ensure_ascii=False)
    now = utcnow()
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": Webhook(claimed.secret).sign(msg_id, now, body),
    }
    try:
        # The whole exchange is bounded (httpx's timeout is per phase), and the answer's
        # body is never read: a receiver cannot make a sender download anything.
        async with asyncio.timeout(seconds):
            async with client.stream(
                "POST", claimed.url, content=body.encode(), headers=headers
            ) as response:
                status = response.status_code
    except TimeoutError:
        return Outcome(None, f"timed out after {seconds:g} s")
    except Refused as exc:  # from the transport, before any connection
        return Outcome(None, _error(f"not sent: the url {exc}"))
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:
        return Outcome(
            None, _error(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        )
    if 200 <= status < 300:
        return Outcome(status, None)
    if 300 <= status < 400:
        return Outcome(status, f"HTTP {status}: a redirect, which is not followed")
    return Outcome(status, f"HTTP {status}")


async def deliver_due(
    maker: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    backoff: Backoff = Backoff(),
    batch: int = BATCH,
    rng: random.Random | None = None,
    resolve: Resolve = resolve,
    network: httpcore.AsyncNetworkBackend | None = None,
) -> int:
    """One pass: send every claimed due delivery once, record each outcome; returns how
    many were delivered.

    ``resolve`` (the system resolver) and ``network`` (httpcore's sockets) are what the
    transport resolves and connects with; tests replace them."""
    timeout = settings.webhook_timeout_seconds
    async with session_scope(maker) as session:
        claimed = await repository.claim(
            session, batch=batch, lease_seconds=timeout + LEASE_MARGIN_SECONDS
        )
    if not claimed:
        return 0
    rng = rng or random.Random()
    async with httpx.AsyncClient(
        timeout=timeout,
        follow_redirects=False,
        transport=WebhookTransport(
            allow_private=settings.webhooks_allow_private, resolve=resolve, network=network
        ),
        trust_env=False,  # no proxy from the environment: the connection is the checked one
    ) as client:
        outcomes = await asyncio.gather(*(_attempt(client, c, seconds=timeout) for c in claimed))
    window = settings.webhook_retry_hours * 3600.0
    async with session_scope(maker) as session:
        for c, outcome in zip(claimed, outcomes, strict=True):
            await repository.settle(
                session,
                c,
                status=outcome.status,
                error=outcome.error,
                delivered=outcome.delivered,
                delay_seconds=backoff.delay(c.attempt, rng),
                window_seconds=window,
            )
    delivered = sum(o.delivered for o in outcomes)
    if delivered < len(claimed):
        log.info("webhooks: %d delivered, %d to retry", delivered, len(claimed) - delivered)
    return delivered
