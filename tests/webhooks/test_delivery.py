"""Delivery from the outbox to a real receiver that verifies every signature.

Events are made the way the service makes them — a run moved through
``app.runs.lifecycle.state.transition``, a checkpoint recorded through ``app.checkpoints.service`` —
and delivered by :func:`app.webhooks.delivery.deliver_due` called directly, with no delay
between attempts (``Backoff(0, 0)``: every failed row is due again at once), so a test
drives each retry itself instead of waiting for minutes.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

from sqlalchemy import select

from app.checkpoints import service as checkpoints
from app.core.settings import Settings
from app.runs.lifecycle.state import transition
from app.runs.lifecycle.status import RunStatus
from app.webhooks import delivery
from app.webhooks.delivery import Backoff, deliver_due
from app.webhooks.models import WebhookDelivery
from tests.support.runs import create_run
from tests.webhooks.receiver import Receiver

NOW = Backoff(base_seconds=0.0, max_delay_seconds=0.0)


async def new_webhook(
    client: Any, tenant: Any, receiver: Receiver, path: str, event_types: list[str]
) -> str:
    r = await client.post(
        "/webhooks",
        json={"url": receiver.url(path), "event_types": event_types},
        headers=tenant.headers,
    )
    assert r.status_code == 201, r.text
    receiver.secrets[path] = r.json()["secret"]
    return str(r.json()["id"])


async def deliveries(client: Any, tenant: Any, webhook_id: str) -> list[dict[str, Any]]:
    r = await client.get(
        f"/webhooks/{webhook_id}/deliveries", params={"limit": 100}, headers=tenant.headers
    )
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


async def drain(sessionmaker: Any, settings: Settings, passes: int = 5) -> None:
    for _ in range(passes):
        await deliver_due(sessionmaker, settings, backoff=NOW)


async def test_run_completed_and_checkpoint_arrive_signed(
    private_client, private_settings, sessionmaker, tenant, receiver
) -> None:
    receiver.start()
    everything = ["run.completed", "run.failed", "checkpoint.saved"]
    all_id = await new_webhook(private_client, tenant, receiver, "/all", everything)
    failed_id = await new_webhook(private_client, tenant, receiver, "/failed", ["run.failed"])
    run = await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.TRAINING)
    async with sessionmaker() as s:
        await checkpoints.record(s, run.id, 2, "/ckpt/2", metrics={"loss": 0.5})
        await checkpoints.record(s, run.id, 2, "/ckpt/final", is_final=True)
        await transition(s, run.id, RunStatus.COMPLETED, message="done")
        await s.commit()
    # The outbox rows exist from the commit on, each with its webhook-id.
    rows = await deliveries(private_client, tenant, all_id)
    assert sorted(d["event_type"] for d in rows) == [
        "checkpoint.saved",
        "checkpoint.saved",
        "run.completed",
    ]
    assert await deliveries(private_client, tenant, failed_id) == []

    await drain(sessionmaker, private_settings)

    got = [r for r in receiver.received if r.path == "/all"]
    assert len(got) == 3 and all(r.verified for r in got), got
    assert {r.webhook_id for r in got} == {d["id"] for d in rows}
    completed = next(r.body for r in got if r.body and r.body["type"] == "run.completed")
    assert completed["data"]["run_id"] == str(run.id)
    assert completed["data"]["status"] == "completed"
    assert completed["data"]["previous_status"] == "training"
    assert completed["data"]["message"] == "done"
    assert completed["timestamp"]
    saved = sorted(
        (r.body["data"] for r in got if r.body and r.body["type"] == "checkpoint.saved"),
        key=lambda d: d["is_final"],
    )
    assert [(d["step"], d["is_final"], d["path"]) for d in saved] == [
        (2, False, "/ckpt/2"),
        (2, True, "/ckpt/final"),
    ]
    assert saved[0]["metrics"] == {"loss": 0.5}
    assert not [r for r in receiver.received if r.path == "/failed"]

    rows = await deliveries(private_client, tenant, all_id)
    assert all(
        d["state"] == "delivered"
        and d["attempts"] == 1
        and d["last_status"] == 204
        and d["delivered_at"]
        and d["next_attempt_at"] is None
        for d in rows
    ), rows


async def test_receiver_down_then_up_gets_each_event_exactly_once(
    private_client, private_settings, sessionmaker, tenant, receiver
) -> None:
    # The webhook points at a port nothing listens on yet.
    types = ["run.paused", "run.cancelled", "checkpoint.saved"]
    webhook_id = await new_webhook(private_client, tenant, receiver, "/hook", types)
    paused = await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.TRAINING)
    cancelled = await create_run(
        sessionmaker, project_id=tenant.project_id, status=RunStatus.COLLECTING
    )
    async with sessionmaker() as s:
        await checkpoints.record(s, paused.id, 1, "/ckpt/1")
        await transition(s, paused.id, RunStatus.PAUSED)
        await transition(s, cancelled.id, RunStatus.CANCELLED)
        await s.commit()

    for _ in range(3):  # down for three attempts
        await deliver_due(sessionmaker, private_settings, backoff=NOW)
    rows = await deliveries(private_client, tenant, webhook_id)
    assert len(rows) == 3
    for d in rows:
        assert d["state"] == "pending" and d["attempts"] == 3, d
        assert d["last_status"] is None and "ConnectError" in d["last_error"], d
    assert receiver.received == []

    receiver.start()
    # Several senders at once (as several worker processes would): each row is claimed by
    # one of them only.
    await asyncio.gather(
        *(deliver_due(sessionmaker, private_settings, backoff=NOW) for _ in range(4))
    )
    await drain(sessionmaker, private_settings)

    got = receiver.acknowledged()
    assert all(r.verified for r in receiver.received)
    assert Counter(r.webhook_id for r in got) == {d["id"]: 1 for d in rows}
    assert len(receiver.received) == 3  # nothing sent again once delivered
    assert sorted(r.body["type"] for r in got if r.body) == sorted(types)
    for d in await deliveries(private_client, tenant, webhook_id):
        assert d["state"] == "delivered" and d["attempts"] == 4 and d["last_error"] is None, d


async def test_a_failed_answer_is_retried_with_the_same_webhook_id(
    private_client, private_settings, sessionmaker, tenant, receiver
) -> None:
    receiver.start()
    receiver.answers = [500, 302]
    webhook_id = await new_webhook(private_client, tenant, receiver, "/flaky", ["run.failed"])
    run = await create_run(sessionmaker, project_id=tenant.project_id, status=RunStatus.SCORING)
    async with sessionmaker() as s:
        await transition(s, run.id, RunStatus.FAILED, error="judge down")
        await s.commit()

    await deliver_due(sessionmaker, private_settings, backoff=NOW)
    [row] = await deliveries(private_client, tenant, webhook_id)
    assert (row["state"], row["last_status"], row["last_error"]) == ("pending", 500, "HTTP 500")
    await deliver_due(sessionmaker, private_settings, backoff=NOW)
    [row] = await deliveries(private_client, tenant, webhook_id)
    # A redirect is an answer, not a place to go: nothing was sent to /elsewhere.
    assert row["last_status"] == 302 and "redirect" in row["last_error"]
    assert {r.path for r in receiver.received} == {"/flaky"}
    await drain(sessionmaker, private_settings)

    assert [r.answered for r in receiver.received] == [500, 302, 204]
    assert {r.webhook_id for r in receiver.received} == {row["id"]}
    assert all(r.verified for r in receiver.received)
    body = receiver.received[-1].body
    assert body and body["data"]["error"] == "judge down"
    [row] = await deliveries(private_client, tenant, webhook_id)
    assert (row["state"], row["attempts"], row["last_status"]) == ("delivered", 3, 204)


async def test_rotation_signs_retries_with_the_new_secret(
    private_client, private_settings, sessionmaker, tenant, receiver
) -> None:
    receiver.start()
    webhook_id = await new_webhook(private_client, tenant, receiver, "/rot", ["run.cancelled"])
    run = await create_run(sessionmaker, project_id=tenant.project_id)
    async with sessionmaker() as s:
        await transition(s, run.id, RunStatus.CANCELLED)
        await s.commit()
    r = await private_client.post(f"/webhooks/{webhook_id}/rotate", headers=tenant.headers)
    old = receiver.secrets["/rot"]
    receiver.secrets["/rot"] = r.json()["secret"]
    assert receiver.secrets["/rot"] != old
    await drain(sessionmaker, private_settings)
    assert [(x.verified, x.answered) for x in receiver.received] == [(True, 204)]


async def test_given_up_after_the_retry_window(
    private_client, private_settings, sessionmaker, tenant, receiver
) -> None:
    webhook_id = await new_webhook(private_client, tenant, receiver, "/late", ["run.cancelled"])
    run = await create_run(sessionmaker, project_id=tenant.project_id)
    async with sessionmaker() as s:
        await transition(s, run.id, RunStatus.CANCELLED)
        await s.commit()
    # A window already over: the first failed attempt is also the last.
    over = private_settings.model_copy(update={"webhook_retry_hours": 1e-9})
    await deliver_due(sessionmaker, over, backoff=NOW)
    receiver.start()
    await drain(sessionmaker, over)
    [row] = await deliveries(private_client, tenant, webhook_id)
    assert (row["state"], row["attempts"], row["next_attempt_at"]) == ("failed", 1, None)
    assert "ConnectError" in row["last_error"]
    assert receiver.received == []


async def test_a_target_turned_private_is_not_sent_to(
    private_client, private_settings, sessionmaker, tenant, receiver
) -> None:
    receiver.start()
    webhook_id = await new_webhook(private_client, tenant, receiver, "/in", ["run.cancelled"])
    run = await create_run(sessionmaker, project_id=tenant.project_id)
    async with sessionmaker() as s:
        await transition(s, run.id, RunStatus.CANCELLED)
        await s.commit()
    strict = private_settings.model_copy(update={"webhooks_allow_private": False})
    await deliver_due(sessionmaker, strict, backoff=NOW)
    [row] = await deliveries(private_client, tenant, webhook_id)
    assert row["state"] == "pending" and row["last_error"].startswith("not sent"), row
    assert receiver.received == []


def test_backoff_is_exponential_with_full_jitter() -> None:
    backoff = Backoff(base_seconds=10, max_delay_seconds=3600)
    rng = random.Random(7)
    for attempt, ceiling in ((1, 10), (2, 20), (5, 160), (10, 3600), (500, 3600)):
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling * 0.8  # spread over the whole range, not fixed
        assert min(delays) < ceiling * 0.2


async def test_the_outbox_is_written_with_the_event_or_not_at_all(
    private_client, sessionmaker, tenant, receiver
) -> None:
    webhook_id = await new_webhook(private_client, tenant, receiver, "/tx", ["run.cancelled"])
    run = await create_run(sessionmaker, project_id=tenant.project_id)
    async with sessionmaker() as s:
        await transition(s, run.id, RunStatus.CANCELLED)
        pending = (
            (
                await s.execute(
                    select(WebhookDelivery.id).where(WebhookDelivery.webhook_id == webhook_id)
                )
            )
            .scalars()
            .all()
        )
        assert pending  # visible inside the transaction that wrote the event …
        await s.rollback()
    assert await deliveries(private_client, tenant, webhook_id) == []  # … gone with it


def test_the_triggers_notify_the_senders_channel() -> None:
    from tests.support import ROOT

    migration = (ROOT / "migrations" / "versions" / "0009_webhooks.py").read_text()
    assert f'_CHANNEL = "{delivery.CHANNEL}"' in migration
