"""Run events as the writers append them, and subscribers that collect them, for the event
hub's tests."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from sqlalchemy import text

from app.events.fanout import EventHub, Subscription
from app.events.sse import KEEP_ALIVE
from tests.support.runs import run_body


async def new_run(client: Any, tenant: Any) -> uuid.UUID:
    answer = await client.post("/runs", json=run_body(), headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    return uuid.UUID(answer.json()["id"])


async def append_events(
    sessionmaker: Any, run_id: uuid.UUID, n: int, *, end: bool = False
) -> list[int]:
    """``n`` events in one transaction holding the run's row lock, as every writer appends;
    with ``end`` the run is cancelled in the same transaction."""
    async with sessionmaker() as s, s.begin():
        await s.execute(text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": run_id})
        ids = (
            await s.execute(
                text(
                    "INSERT INTO run_events (run_id, type, level, message, data)"
                    " SELECT :id, 'log', 'info', 'event ' || g, '{}'::jsonb"
                    " FROM generate_series(1, :n) AS g RETURNING id"
                ),
                {"id": run_id, "n": n},
            )
        ).scalars()
        if end:
            await s.execute(
                text("UPDATE runs SET status = 'cancelled' WHERE id = :id"), {"id": run_id}
            )
        return sorted(ids)


async def event_ids(sessionmaker: Any, run_id: uuid.UUID) -> list[int]:
    async with sessionmaker() as s:
        rows = await s.execute(
            text("SELECT id FROM run_events WHERE run_id = :id ORDER BY id"), {"id": run_id}
        )
        return list(rows.scalars())


async def hub_listening(hub: EventHub) -> None:
    async with asyncio.timeout(10):
        await hub.listening()


def event_id(message: str) -> int | None:
    first = message.split("\n", 1)[0]
    return int(first[4:]) if first.startswith("id: ") else None


async def each_message(subscription: Subscription) -> AsyncIterator[str]:
    """The subscription's messages one by one (it writes what came at once in one chunk),
    keep-alives left out."""
    async for chunk in subscription.messages():
        for message in chunk.decode().split("\n\n")[:-1]:
            if (message + "\n\n").encode() != KEEP_ALIVE:
                yield message + "\n\n"


class Collected(list[str]):
    """What one subscriber received (keep-alives left out); tests wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Condition()

    async def collect(self, subscription: Subscription) -> None:
        async for message in each_message(subscription):
            async with self.changed:
                self.append(message)
                self.changed.notify_all()

    async def wait_for(self, predicate: Callable[[list[str]], bool]) -> None:
        async with asyncio.timeout(10), self.changed:
            await self.changed.wait_for(lambda: predicate(self))


def ended(got: list[str]) -> bool:
    return bool(got) and got[-1].startswith("event: end")


def count(n: int) -> Callable[[list[str]], bool]:
    return lambda got: len(got) >= n


@contextlib.asynccontextmanager
async def streams(hub: EventHub, run_id: uuid.UUID, n: int) -> AsyncIterator[list[Collected]]:
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


async def all_received(received: list[Collected], predicate: Callable[[list[str]], bool]) -> None:
    await asyncio.gather(*(got.wait_for(predicate) for got in received))
