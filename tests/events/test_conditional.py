"""ETag / If-None-Match on a run's event pages and metric series (app/events/conditional.py):
a 304 while nothing new, from what the hub knows and with no query; a fresh answer as soon as
an event (or a metrics write, which always comes with one) commits. A 304 answered before
routing keeps every check the route makes: the key, the rate limit, the query's validity."""

from __future__ import annotations

import uuid
import zlib
from typing import Any

import asyncpg
from sqlalchemy import text

from app.core.pg import connect_kwargs
from app.core.settings import get_settings
from app.events.fanout import EventHub
from tests.support.database import app_on, client_of
from tests.support.events import append_events, event_id, hub_listening, new_run, streams
from tests.support.prometheus import value


async def _get(client: Any, url: str, tenant: Any, tag: str | None = None, **params: Any) -> Any:
    headers = dict(tenant.headers)
    if tag is not None:
        headers["If-None-Match"] = tag
    return await client.get(url, params=params, headers=headers)


async def test_event_pages_answer_304_until_an_event_commits(
    api: Any, client: Any, tenant: Any, sessionmaker: Any
) -> None:
    await hub_listening(api.state.event_hub)
    run_id = await new_run(client, tenant)
    url = f"/runs/{run_id}/events"
    first = await _get(client, url, tenant, limit=10)
    assert first.status_code == 200
    tag = first.headers["ETag"]
    again = await _get(client, url, tenant, tag, limit=10)
    assert again.status_code == 304 and again.content == b""
    assert again.headers["ETag"] == tag
    # Weak comparison, lists and `*`, as RFC 9110 says.
    for sent in (f"W/{tag}", f'"other", {tag}', "*"):
        assert (await _get(client, url, tenant, sent, limit=10)).status_code == 304
    # Another URL of the same run has a tag of its own.
    assert (await _get(client, url, tenant, tag, limit=11)).status_code == 200

    async with streams(api.state.event_hub, run_id, 1) as (heard,):
        (new_id,) = await append_events(sessionmaker, run_id, 1)
        # The hub knows of an event once its notification arrived: the stream shows when.
        await heard.wait_for(lambda got: bool(got) and event_id(got[-1]) == new_id)
    fresh = await _get(client, url, tenant, tag, limit=10)
    assert fresh.status_code == 200
    assert fresh.headers["ETag"] != tag
    assert fresh.json()["data"][-1]["id"] == new_id
    assert (await _get(client, url, tenant, fresh.headers["ETag"], limit=10)).status_code == 304


async def test_metrics_answer_304_until_a_metrics_write(
    api: Any, client: Any, tenant: Any, sessionmaker: Any
) -> None:
    await hub_listening(api.state.event_hub)
    run_id = await new_run(client, tenant)
    url = f"/runs/{run_id}/metrics"
    first = await _get(client, url, tenant)
    assert first.status_code == 200 and first.json()["series"] == []
    tag = first.headers["ETag"]
    assert (await _get(client, url, tenant, tag)).status_code == 304

    # A metrics write, as every writer makes it: the points and an event, one transaction.
    async with streams(api.state.event_hub, run_id, 1) as (heard,):
        async with sessionmaker() as s, s.begin():
            await s.execute(text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": run_id})
            await s.execute(
                text(
                    "INSERT INTO metric_points (run_id, step, name, value)"
                    " VALUES (:id, 1, 'reward_mean', 0.5)"
                ),
                {"id": run_id},
            )
            new_id = await s.scalar(
                text(
                    "INSERT INTO run_events (run_id, type, level, message, data)"
                    " VALUES (:id, 'step', 'info', 'step 1', '{}') RETURNING id"
                ),
                {"id": run_id},
            )
        await heard.wait_for(lambda got: bool(got) and event_id(got[-1]) == new_id)
    fresh = await _get(client, url, tenant, tag)
    assert fresh.status_code == 200
    assert fresh.json()["series"][0]["points"] == [{"step": 1, "value": 0.5}]


async def test_a_304_costs_no_query(
    api: Any, client: Any, tenant: Any, service_urls: tuple[str, str]
) -> None:
    await hub_listening(api.state.event_hub)
    run_id = await new_run(client, tenant)
    urls = [f"/runs/{run_id}/events", f"/runs/{run_id}/metrics"]
    tags = [(await _get(client, url, tenant)).headers["ETag"] for url in urls]
    observer = await asyncpg.connect(**connect_kwargs(service_urls[0]))
    last_query = (
        "SELECT max(query_start) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'trainyard-api'"
    )
    try:
        before = await observer.fetchval(last_query)
        for _ in range(20):
            for url, tag in zip(urls, tags, strict=True):
                assert (await _get(client, url, tenant, tag)).status_code == 304
        assert await observer.fetchval(last_query) == before
    finally:
        await observer.close()


async def test_another_projects_tag_is_still_a_404(
    api: Any, client: Any, tenant: Any, make_tenant: Any
) -> None:
    await hub_listening(api.state.event_hub)
    run_id = await new_run(client, tenant)
    url = f"/runs/{run_id}/events"
    tag = (await _get(client, url, tenant)).headers["ETag"]
    stranger = await make_tenant()
    assert (await _get(client, url, stranger, tag)).status_code == 404
    assert (await _get(client, f"/runs/{uuid.uuid4()}/events", tenant, tag)).status_code == 404


async def test_without_the_hub_the_database_answers(
    api: Any, client: Any, tenant: Any, sessionmaker: Any, service_urls: tuple[str, str]
) -> None:
    """A hub that is not listening (its connection being remade) knows nothing: the tag is
    checked against a read of the database, which still answers 304 when nothing changed."""
    run_id = await new_run(client, tenant)
    url = f"/runs/{run_id}/events"
    tag = (await _get(client, url, tenant)).headers["ETag"]
    deaf = EventHub(service_urls[0], api.state.pg, buffer=10, keepalive_seconds=15)
    listening = api.state.event_hub
    api.state.event_hub = deaf  # never started
    try:
        assert (await _get(client, url, tenant, tag)).status_code == 304
        await append_events(sessionmaker, run_id, 1)
        assert (await _get(client, url, tenant, tag)).status_code == 200
    finally:
        api.state.event_hub = listening


async def test_a_304_before_routing_keeps_the_routes_checks(
    api: Any, client: Any, tenant: Any
) -> None:
    await hub_listening(api.state.event_hub)
    run_id = await new_run(client, tenant)
    url = f"/runs/{run_id}/events"
    tag = (await _get(client, url, tenant, limit=10)).headers["ETag"]
    metric = {"route": "/runs/{run_id}/events", "status": "304", "method": "GET"}
    before = value((await client.get("/metrics")).text, "trainyard_http_requests_total", **metric)
    for _ in range(3):
        again = await _get(client, url, tenant, tag, limit=10)
        assert again.status_code == 304 and again.headers["ETag"] == tag
        assert again.headers["x-request-id"]
    # Counted under the route's template, as a 304 the route answers.
    after = value((await client.get("/metrics")).text, "trainyard_http_requests_total", **metric)
    assert after == before + 3

    # A query the route refuses, with the tag it would have: the route's 422, every time.
    latest = tag.strip('"').split(".")[0]
    forged = f'"{latest}.{zlib.crc32(b"limit=0"):08x}"'
    for _ in range(2):
        refused = await _get(client, url, tenant, forged, limit=0)
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["field"] == "query.limit"
    # No key, or one the service does not know: the route's 401, whatever the tag.
    assert (
        await client.get(url, params={"limit": 10}, headers={"If-None-Match": tag})
    ).status_code == 401
    unknown = {"Authorization": "Bearer ty_unknown", "If-None-Match": tag}
    assert (await client.get(url, params={"limit": 10}, headers=unknown)).status_code == 401


async def test_a_304_before_routing_counts_once_against_the_rate_limit(
    service_urls: tuple[str, str], make_tenant: Any
) -> None:
    settings = get_settings().model_copy(
        update={"rate_limit_per_second": 0.01, "rate_limit_burst": 4}
    )
    async with app_on(settings) as app, client_of(app) as client:
        await hub_listening(app.state.event_hub)
        tenant = await make_tenant()
        run_id = await new_run(client, tenant)  # 1 of 4
        url = f"/runs/{run_id}/metrics"
        first = await _get(client, url, tenant)  # 2
        assert first.headers["ratelimit-remaining"] == "2"
        remaining = []
        for _ in range(2):  # 3, 4
            again = await _get(client, url, tenant, first.headers["ETag"])
            assert again.status_code == 304
            remaining.append(again.headers["ratelimit-remaining"])
        assert remaining == ["1", "0"]
        refused = await _get(client, url, tenant, first.headers["ETag"])
        assert refused.status_code == 429
        assert refused.headers["content-type"] == "application/problem+json"
