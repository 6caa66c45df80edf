"""The event hub (app/events/fanout.py) on real PostgreSQL LISTEN/NOTIFY: every subscriber
gets every event once and in order, idle streams cost no query, a lost LISTEN connection
loses nothing, and a slow subscriber is closed without slowing the others."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
from sqlalchemy import text

from app.core.pg import connect_kwargs
from app.events.fanout import CHANNEL, EventHub
from app.events.sse import KEEP_ALIVE, TOO_FAR_BEHIND
from tests.support.events import (
    all_received,
    append_events,
    count,
    each_message,
    ended,
    event_id,
    event_ids,
    hub_listening,
    new_run,
    streams,
)


async def test_every_subscriber_gets_every_event_once_in_order(
    api: Any, client: Any, tenant: Any, sessionmaker: Any
) -> None:
    hub: EventHub = api.state.event_hub
    await hub_listening(hub)
    run_id = await new_run(client, tenant)
    async with streams(hub, run_id, 5) as received:
        for _ in range(10):  # while the streams catch up and after
            await append_events(sessionmaker, run_id, 3)
        await append_events(sessionmaker, run_id, 1, end=True)
        await all_received(received, ended)
    expected = await event_ids(sessionmaker, run_id)
    for got in received:
        assert [event_id(m) for m in got[:-1]] == expected
        assert got[-1] == 'event: end\ndata: {"status": "cancelled"}\n\n'


async def test_idle_streams_run_no_query(
    api: Any, client: Any, tenant: Any, sessionmaker: Any, service_urls: tuple[str, str]
) -> None:
    """Twenty open streams of a quiet run, caught up: the API's connections stay idle (a
    polling stream would query every half second), and one event still reaches all twenty."""
    hub: EventHub = api.state.event_hub
    await hub_listening(hub)
    run_id = await new_run(client, tenant)
    # Every other connection to this database: the API's pool, its engine, the hub's own.
    last_query = (
        "SELECT max(query_start) FROM pg_stat_activity WHERE datname = current_database()"
        " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
    )
    async with streams(hub, run_id, 20) as received:
        await all_received(received, count(len(await event_ids(sessionmaker, run_id))))
        observer = await asyncpg.connect(**connect_kwargs(service_urls[0]))
        try:
            before = await observer.fetchval(last_query)
            await asyncio.sleep(1.5)  # three polls of a stream that polls
            after = await observer.fetchval(last_query)
        finally:
            await observer.close()
        assert after == before, "an idle stream queried the database"
        ids = await append_events(sessionmaker, run_id, 1)
        await all_received(received, lambda got: event_id(got[-1]) == ids[0])
    expected = await event_ids(sessionmaker, run_id)
    for got in received:
        assert [event_id(m) for m in got] == expected


async def test_a_lost_listen_connection_loses_nothing(
    api: Any, client: Any, tenant: Any, sessionmaker: Any
) -> None:
    hub: EventHub = api.state.event_hub
    await hub_listening(hub)
    run_id = await new_run(client, tenant)
    async with streams(hub, run_id, 3) as received:
        await append_events(sessionmaker, run_id, 2)
        await all_received(received, count(len(await event_ids(sessionmaker, run_id))))
        # Its own connection: other apps' hubs may listen on this database too.
        async with sessionmaker() as s:
            killed = await s.scalar(
                text("SELECT pg_terminate_backend(:pid)"), {"pid": hub.backend_pid}
            )
        assert killed is True
        # Written while nobody listens: their notifications are lost with the connection.
        await append_events(sessionmaker, run_id, 2)
        await append_events(sessionmaker, run_id, 2, end=True)
        await all_received(received, ended)
    await hub_listening(hub)
    expected = await event_ids(sessionmaker, run_id)
    for got in received:
        assert [event_id(m) for m in got[:-1]] == expected


async def test_a_slow_subscriber_is_closed_and_the_others_get_everything(
    api: Any,
    client: Any,
    tenant: Any,
    sessionmaker: Any,
    service_urls: tuple[str, str],
) -> None:
    hub = EventHub(service_urls[0], api.state.pg, buffer=5, keepalive_seconds=15)
    hub.start()
    try:
        await hub_listening(hub)
        run_id = await new_run(client, tenant)
        await append_events(sessionmaker, run_id, 1)
        initial = await event_ids(sessionmaker, run_id)
        async with hub.subscribe(run_id, 0) as slow, streams(hub, run_id, 1) as (fast,):
            slow_messages = each_message(slow)
            assert [event_id(await anext(slow_messages)) for _ in initial] == initial
            # The slow one reads nothing while 20 events arrive, one transaction each.
            for _ in range(20):
                await append_events(sessionmaker, run_id, 1)
            await fast.wait_for(count(len(initial) + 20))
            assert await anext(slow_messages) == TOO_FAR_BEHIND.decode()
            # Its client reconnects from the last id it got and reads the rest.
            async with hub.subscribe(run_id, initial[-1]) as resumed:
                resumed_messages = each_message(resumed)
                rest = [event_id(await anext(resumed_messages)) for _ in range(20)]
        expected = await event_ids(sessionmaker, run_id)
        assert [event_id(m) for m in fast] == expected
        assert rest == expected[len(initial) :]
    finally:
        await hub.close()


async def test_an_idle_stream_gets_a_keep_alive_each_period(
    api: Any, client: Any, tenant: Any, sessionmaker: Any, service_urls: tuple[str, str]
) -> None:
    """One timer of the hub's keeps every idle stream alive: a comment after ``keepalive``
    seconds without a message, never sooner, and again each period; an event resets it."""
    keepalive = 0.3
    hub = EventHub(service_urls[0], api.state.pg, buffer=100, keepalive_seconds=keepalive)
    hub.start()
    try:
        await hub_listening(hub)
        run_id = await new_run(client, tenant)
        initial = await event_ids(sessionmaker, run_id)
        async with hub.subscribe(run_id, initial[-1]) as subscription:
            chunks = subscription.messages()
            loop = asyncio.get_running_loop()
            last = loop.time()
            gaps = []
            for _ in range(3):
                async with asyncio.timeout(10):
                    assert await anext(chunks) == KEEP_ALIVE
                gaps.append(loop.time() - last)
                last = loop.time()
            (new_id,) = await append_events(sessionmaker, run_id, 1)
            async with asyncio.timeout(10):
                chunk = await anext(chunks)
            after_event = loop.time()
            assert event_id(chunk.decode()) == new_id
            async with asyncio.timeout(10):
                assert await anext(chunks) == KEEP_ALIVE
        # Each after a full period of silence (the clock's resolution aside), none late by
        # more than a quarter period and a loaded machine's scheduling.
        assert all(keepalive * 0.95 <= gap < keepalive * 4 for gap in gaps), gaps
        assert loop.time() - after_event >= keepalive * 0.95
    finally:
        await hub.close()


async def test_a_runs_creation_notifies_no_stream_its_next_event_does(
    client: Any, tenant: Any, sessionmaker: Any, service_urls: tuple[str, str]
) -> None:
    """Nobody can follow a run before the statement creating it commits, so its `created`
    event wakes no API process (migrations 0015, 0016); every later event notifies, one
    notification per event naming its id (0016)."""
    listener = await asyncpg.connect(**connect_kwargs(service_urls[0]))
    notified: asyncio.Queue[str] = asyncio.Queue()
    payloads: list[str] = []
    try:
        await listener.add_listener(CHANNEL, lambda *args: notified.put_nowait(args[-1]))
        run_id = await new_run(client, tenant)
        ids = await append_events(sessionmaker, run_id, 2)
        # Notifications arrive in commit order: the first ones this run sent are the append's.
        while len(payloads) < len(ids):
            payload = await asyncio.wait_for(notified.get(), 10)
            if payload.startswith(f"{run_id}:"):
                payloads.append(payload)
    finally:
        await listener.close()
    assert payloads == [f"{run_id}:{i}:{i}" for i in ids]
    created, *appended = await event_ids(sessionmaker, run_id)
    assert created < ids[0] and appended == ids  # `created` is stored, only unannounced


async def test_the_hub_listens_only_while_something_needs_it(
    api: Any, client: Any, tenant: Any, sessionmaker: Any, service_urls: tuple[str, str]
) -> None:
    """No LISTEN connection until a stream or a conditional GET needs one (PostgreSQL wakes
    every listener of the database on each NOTIFY); one opened by a stream misses none of
    its events; it closes ``idle_seconds`` after the last need."""
    idle = 0.5
    hub = EventHub(
        service_urls[0], api.state.pg, buffer=100, keepalive_seconds=15, idle_seconds=idle
    )
    hub.start()
    listeners = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'trainyard-hub' AND pid = :pid"
    )
    try:
        run_id = await new_run(client, tenant)
        assert hub.backend_pid is None and hub.epoch() is None  # nothing needed it yet
        await append_events(sessionmaker, run_id, 2)  # before anyone listens
        async with streams(hub, run_id, 1) as (got,):
            await hub_listening(hub)
            pid = hub.backend_pid
            async with sessionmaker() as s:
                assert await s.scalar(text(listeners), {"pid": pid}) == 1
            await append_events(sessionmaker, run_id, 1, end=True)  # after it listens
            await got.wait_for(ended)
        assert [event_id(m) for m in got[:-1]] == await event_ids(sessionmaker, run_id)
        # The stream ended: the connection closes once the hub was idle that long.
        async with asyncio.timeout(idle + 10):
            await hub.not_listening()
        assert hub.backend_pid is None
        async with sessionmaker() as s:
            assert await s.scalar(text(listeners), {"pid": pid}) == 0
        # A conditional GET's question (the hub's latest) starts it again.
        assert hub.latest(run_id, tenant.project_id) is None
        await hub_listening(hub)
        assert hub.backend_pid is not None and hub.backend_pid != pid
    finally:
        await hub.close()
