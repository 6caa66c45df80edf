"""Engine and sessions. Services take an ``AsyncSession`` and never commit: the edge does.

Route handlers commit at the end of a request; workers open :func:`session_scope` per unit
of work. Jobs are published only after the commit that made them due, never from inside an
open transaction: the transaction sends a ``pg_notify`` (delivered on commit) and the
workers' reconciler publishes the task (:mod:`app.runs.lifecycle.dispatch`).

An API process also opens a plain asyncpg pool (:mod:`app.core.pg`) beside this engine;
each gets ``db_pool_size`` connections.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)


def make_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    engine = create_async_engine(
        url,
        pool_size=pool_size,
        # A fixed number of connections per process: under load, requests wait for one
        # (then 503) rather than open more until PostgreSQL's max_connections refuses.
        max_overflow=0,
        pool_pre_ping=False,  # a round trip per checkout; _closed_on_checkout costs none
        connect_args={"server_settings": {"application_name": "trainyard"}},
    )
    event.listen(engine.sync_engine, "checkout", _closed_on_checkout)
    return engine


def _closed_on_checkout(_dbapi: Any, record: Any, _proxy: Any) -> None:
    """A pooled connection the server closed (a PostgreSQL restart, an idle timeout) is
    replaced at checkout, not handed to a request that would fail on it: asyncpg notices
    the closed socket by itself, so the check costs no round trip."""
    driver = record.driver_connection
    if driver is None or driver.is_closed():
        raise DisconnectionError("the server closed this connection")


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False, autoflush=False)


@asynccontextmanager
async def session_scope(maker: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    """One transaction: committed when the block succeeds, rolled back when it raises."""
    async with maker() as session:
        try:
            yield session
        except BaseException:
            await session.rollback()
            raise
        await session.commit()
