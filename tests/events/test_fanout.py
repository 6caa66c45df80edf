"""The event hub (app/events/fanout.py) on real PostgreSQL LISTEN/NOTIFY: every subscriber
gets every event once and in order, idle streams cost no query, a lost LISTEN connection
loses nothing, and a slow subscriber is closed without slowing the others."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
from sqlalchemy import text

from app.core.pg import connect_kwargs
from app.events.fanout import KEEP_ALIVE, TOO_FAR_BEHIND, EventHub, Subscription
from tests.support.events import append_events, event_ids, hub_listening, new_run


def _event_id(message: str) -> int | None:
    first = message.split("\n", 1)[0]
    return int(first[4:]) if first.startswith("id: ") else None


async def _each(subscription: Subscription) -> AsyncIterator[str]:
    """The subscription's messages one by one (it writes what came at once in one chunk),
    keep-alives left out."""
    async for chunk in subscription.messages():
        for message in chunk.split("\n\n")[:-1]:
            if message + "\n\n" != KEEP_ALIVE:
                yield message + "\n\n"


class Collected(list[str]):
    """What one subscriber received (keep-alives left out); tests wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Condition()

    async def collect(self, subscription: Subscription) -> None:
        async for message in _each(subscription):
            async with self.changed:
                self.append(message)
                self.changed.notify_all()

    async def wait_for(self, predicate: Callable[[list[str]], bool]) -> None:
        async with asyncio.timeout(10), self.changed:
            await self.changed.wait_for(lambda: predicate(self))


def _ended(got: list[str]) -> bool:
    return bool(got) and got[-1].startswith("event: end")


def _count(n: int) -> Callable[[list[str]], bool]:
    return lambda got: len(got) >= n


@contextlib.asynccontextmanager
async def _streams(hub: EventHub, run_id: uuid.UUID, n: int) -> AsyncIterator[list[Collected]]:
    """``n`` subscribers of the run from its start, each collecting into its own list."""
    received = [Collected() for _ in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        tasks = []
        for got in received:
            subscription = await stack.enter_async_context(hub.subscribe(run_id, 0))
            tasks.append(asyncio.create_task(got.collect(subscription)))
        try:
            yield received
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _all_received(received: list[Collected], predicate: Callable[[list[str]], bool]) -> None:
    await asyncio.gather(*(got.wait_for(predicate) for got in received))


async def test_every_subscriber_gets_every_event_once_in_order(
    api: Any, client: Any, tenant: Any, sessionmaker: Any
) -> None:
    hub: EventHub = api.state.event_hub
    await hub_listening(hub)
    run_id = await new_run(client, tenant)
    async with _streams(hub, run_id, 5) as received:
        for _ in range(10):  # while the streams catch up and after
            await append_events(sessionmaker, run_id, 3)
        await append_events(sessionmaker, run_id, 1, end=True)
        await _all_received(received, _ended)
    expected = await event_ids(sessionmaker, run_id)
    for got in received:
        assert [_event_id(m) for m in got[:-1]] == expected
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
    async with _streams(hub, run_id, 20) as received:
        await _all_received(received, _count(len(await event_ids(sessionmaker, run_id))))
        observer = await asyncpg.connect(**connect_kwargs(service_urls[0]))
        try:
            before = await observer.fetchval(last_query)
            await asyncio.sleep(1.5)  # three polls of a stream that polls
            after = await observer.fetchval(last_query)
        finally:
            await observer.close()
        assert after == before, "an idle stream queried the database"
        ids = await append_events(sessionmaker, run_id, 1)
        await _all_received(received, lambda got: _event_id(got[-1]) == ids[0])
    expected = await event_ids(sessionmaker, run_id)
    for got in received:
        assert [_event_id(m) for m in got] == expected


async def test_a_lost_listen_connection_loses_nothing(
    api: Any, client: Any, tenant: Any, sessionmaker: Any
) -> None:
    hub: EventHub = api.state.event_hub
    await hub_listening(hub)
    run_id = await new_run(client, tenant)
    async with _streams(hub, run_id, 3) as received:
        await append_events(sessionmaker, run_id, 2)
        await _all_received(received, _count(len(await event_ids(sessionmaker, run_id))))
        async with sessionmaker() as s:
            killed = await s.scalar(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE datname = current_database()"
                    " AND application_name = 'trainyard-hub'"
                )
            )
        assert killed == 1
        # Written while nobody listens: their notifications are lost with the connection.
        await append_events(sessionmaker, run_id, 2)
        await append_events(sessionmaker, run_id, 2, end=True)
        await _all_received(received, _ended)
    await hub_listening(hub)
    expected = await event_ids(sessionmaker, run_id)
    for got in received:
        assert [_event_id(m) for m in got[:-1]] == expected


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
        async with hub.subscribe(run_id, 0) as slow, _streams(hub, run_id, 1) as (fast,):
            slow_messages = _each(slow)
            assert [_event_id(await anext(slow_messages)) for _ in initial] == initial
            # The slow one reads nothing while 20 events arrive, one transaction each.
            for _ in range(20):
                await append_events(sessionmaker, run_id, 1)
            await fast.wait_for(_count(len(initial) + 20))
            assert await anext(slow_messages) == TOO_FAR_BEHIND
            # Its client reconnects from the last id it got and reads the rest.
            async with hub.subscribe(run_id, initial[-1]) as resumed:
                resumed_messages = _each(resumed)
                rest = [_event_id(await anext(resumed_messages)) for _ in range(20)]
        expected = await event_ids(sessionmaker, run_id)
        assert [_event_id(m) for m in fast] == expected
        assert rest == expected[len(initial) :]
    finally:
        await hub.close()
