"""The API's DueBell: a create rings it after its commit, and the workers' reconciler hears
one NOTIFY per ring made while none was in flight (creates commit without a NOTIFY of
their own: app/runs/lifecycle/dispatch.py)."""

from __future__ import annotations

import asyncio

import asyncpg

from app.core.pg import connect_kwargs, create_pool
from app.runs.lifecycle.dispatch import DUE_CHANNEL, DueBell


async def test_rings_made_together_wake_the_reconciler_once_and_a_later_ring_again(
    sessionmaker,
) -> None:
    url = sessionmaker.kw["bind"].url.render_as_string(hide_password=False)
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(**connect_kwargs(url))
    await listener.add_listener(DUE_CHANNEL, lambda *args: heard.put_nowait(args[-1]))
    pool = await create_pool(url, size=2)
    bell = DueBell(pool)
    bell.start()
    try:
        for _ in range(100):  # a burst of creates, none awaited in between
            bell.ring()
        await asyncio.wait_for(heard.get(), 10)
        bell.ring()  # a create after the NOTIFY went out: heard again
        await asyncio.wait_for(heard.get(), 10)
        assert heard.empty()
    finally:
        await bell.aclose()
        await pool.close()
        await listener.close()


async def test_a_ring_not_sent_yet_is_sent_on_close(sessionmaker) -> None:
    url = sessionmaker.kw["bind"].url.render_as_string(hide_password=False)
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(**connect_kwargs(url))
    await listener.add_listener(DUE_CHANNEL, lambda *args: heard.put_nowait(args[-1]))
    pool = await create_pool(url, size=2)
    bell = DueBell(pool)  # never started: as if the process stopped before its task ran
    try:
        bell.ring()
        await bell.aclose()
        await asyncio.wait_for(heard.get(), 10)
    finally:
        await pool.close()
        await listener.close()
