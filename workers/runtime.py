"""The worker's database runtime: one event loop on a background thread per process.

Celery tasks are synchronous; the services are async. Tasks hand coroutines to this loop
and wait, so the loop also keeps heartbeats going while a task's main thread is busy (the
GIL is released by I/O and by torch kernels).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Any, TypeVar

import asyncpg
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

import app.models  # noqa: F401  (every table registered before the first query)
from app.catalog.policy import CodePolicy
from app.core.db import make_engine, make_sessionmaker, session_scope
from app.core.pg import create_pool
from app.core.services import database_url
from app.core.settings import Settings, get_settings

T = TypeVar("T")


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Read at start, as the API does: a bad catalog stops the worker with the reason.
        self.policy = CodePolicy.from_settings(settings)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="trainyard-db", daemon=True
        )
        self._thread.start()
        self.url = database_url(settings)
        self.engine = make_engine(self.url, pool_size=4)
        self.sessionmaker: async_sessionmaker[AsyncSession] = make_sessionmaker(self.engine)
        self._pg: asyncpg.Pool | None = None
        self._pg_lock = asyncio.Lock()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the runtime loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with session_scope(self.sessionmaker) as session:
            yield session

    @asynccontextmanager
    async def pg(self) -> AsyncIterator[asyncpg.Connection]:
        """A plain asyncpg connection, for the per-step statements
        (``app.runs.lifecycle.step_moves``) that run while the trainer waits."""
        if self._pg is None:
            async with self._pg_lock:
                if self._pg is None:
                    self._pg = await create_pool(self.url, size=2, name="trainyard-worker")
        async with self._pg.acquire() as conn:
            yield conn


@lru_cache
def get_runtime() -> Runtime:
    return Runtime(get_settings())
