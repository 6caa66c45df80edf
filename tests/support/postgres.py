"""A PostgreSQL server of a test's own (the embedded one, in the test's folder), which the test
may stop and start while the API and workers use it; the machine's server is never touched."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from app.core.embedded import EmbeddedService, start_postgres
from app.core.settings import get_settings
from tests.support.database import OwnDatabase, delete_broker_keys


class OwnPostgres:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.server: EmbeddedService = start_postgres(home)
        self.url = self.server.url

    async def stop(self) -> None:
        """A fast shutdown (SIGINT): sessions are cut, nothing committed is lost. Off the
        event loop, which goes on (and sees its connections close) meanwhile."""
        await asyncio.to_thread(self.server.stop)

    async def start(self) -> None:
        self.server = await asyncio.to_thread(start_postgres, self.home)
        assert self.server.url == self.url


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[OwnPostgres]:
    from app.cli.db import upgrade

    server = OwnPostgres(tmp_path / "postgres")
    try:
        upgrade(server.url)
        yield server
    finally:
        server.server.stop()


@pytest.fixture
async def own_database(
    own_postgres: OwnPostgres, service_urls: tuple[str, str]
) -> AsyncIterator[OwnDatabase]:
    """``own_database`` (tests/support/database.py) on the test's own server: the API, the
    sessions and the workers of a test that asks for it all use that server."""
    broker = service_urls[1]
    prefix = f"own-pg-{uuid.uuid4().hex[:8]}:"
    settings = get_settings().model_copy(
        update={"database_url": own_postgres.url, "broker_prefix": prefix}
    )
    try:
        yield OwnDatabase(own_postgres.url, broker, prefix, settings)
    finally:
        delete_broker_keys(broker, prefix)
