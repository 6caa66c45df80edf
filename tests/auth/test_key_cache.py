"""The API-key cache on the real database: concurrent misses share one lookup, a lookup is
no write (last_used_at is refreshed at most once a minute, off the request path), revoked
keys stop within the cache's ttl, and a failed or abandoned lookup harms nobody else.

These are what made the GET tail short (docs/benchmarks.md, "Where the time went")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from app.auth import service
from app.auth.roles import Role
from app.auth.service import KeyCache, Principal, authenticate, revoke_key
from app.core.pg import connect_kwargs, init_connection


class Statements:
    """Every statement the pool's connections run, from asyncpg's own query logger."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def log(self, record: Any) -> None:
        self.seen.append(record.query)

    def count(self, verb: str) -> int:
        """Statements on api_keys starting with ``verb`` (asyncpg's own introspection
        queries are logged too)."""
        return sum(1 for q in self.seen if q.lstrip().upper().startswith(verb) and "api_keys" in q)


@pytest.fixture
async def logged_pool(
    service_urls: tuple[str, str],
) -> AsyncIterator[tuple[asyncpg.Pool, Statements]]:
    statements = Statements()

    async def init(conn: asyncpg.Connection) -> None:
        await init_connection(conn)
        conn.add_query_logger(statements.log)

    pool = await asyncpg.create_pool(
        **connect_kwargs(service_urls[0]), min_size=1, max_size=4, init=init
    )
    yield pool, statements
    await pool.close()


async def _touched() -> None:
    """Wait for the background last_used_at refreshes started so far."""
    await asyncio.gather(*service._background)


async def test_concurrent_misses_share_one_lookup_and_a_lookup_is_no_write(
    logged_pool: tuple[asyncpg.Pool, Statements], tenant: Any
) -> None:
    pool, statements = logged_pool
    cache = KeyCache()
    expected = Principal(project_id=tenant.project_id, key_id=tenant.key_id, role=Role.admin)

    answers = await asyncio.gather(*[authenticate(pool, tenant.key, cache) for _ in range(20)])
    assert answers == [expected] * 20
    await _touched()
    assert (statements.count("SELECT"), statements.count("UPDATE")) == (1, 1)

    # Cached: no statement at all.
    await asyncio.gather(*[authenticate(pool, tenant.key, cache) for _ in range(20)])
    assert (statements.count("SELECT"), statements.count("UPDATE")) == (1, 1)

    # Expired (as every ttl seconds): one shared lookup again, and no write, because
    # last_used_at was refreshed less than a minute ago.
    cache.clear()
    answers = await asyncio.gather(*[authenticate(pool, tenant.key, cache) for _ in range(20)])
    assert answers == [expected] * 20
    await _touched()
    assert (statements.count("SELECT"), statements.count("UPDATE")) == (2, 1)


async def test_unknown_keys_are_not_cached(
    logged_pool: tuple[asyncpg.Pool, Statements],
) -> None:
    pool, statements = logged_pool
    cache = KeyCache()
    for _ in range(2):
        assert await authenticate(pool, "ty_no-such-key", cache) is None
    assert statements.count("SELECT") == 2


async def test_a_revoked_key_stops_working_when_its_entry_expires(
    logged_pool: tuple[asyncpg.Pool, Statements], tenant: Any, sessionmaker: Any
) -> None:
    pool, _ = logged_pool
    cached, expiring = KeyCache(ttl=3600), KeyCache(ttl=0)
    for cache in (cached, expiring):
        assert await authenticate(pool, tenant.key, cache) is not None
    async with sessionmaker() as s:
        assert await revoke_key(s, tenant.key_id)
        await s.commit()
    assert await authenticate(pool, tenant.key, cached) is not None  # until its ttl is up
    assert await authenticate(pool, tenant.key, expiring) is None
    await _touched()


async def test_a_failed_lookup_reaches_every_waiter_and_is_not_kept(
    logged_pool: tuple[asyncpg.Pool, Statements], tenant: Any, service_urls: tuple[str, str]
) -> None:
    pool, _ = logged_pool
    cache = KeyCache()
    broken = await asyncpg.create_pool(**connect_kwargs(service_urls[0]), min_size=0)
    await broken.close()
    answers = await asyncio.gather(
        *[authenticate(broken, tenant.key, cache) for _ in range(5)], return_exceptions=True
    )
    assert all(isinstance(a, asyncpg.InterfaceError) for a in answers), answers
    # Nothing cached and nothing left pending: the next request asks again, and succeeds.
    assert await authenticate(pool, tenant.key, cache) is not None
    await _touched()


async def test_a_request_that_gives_up_leaves_the_lookup_to_the_others(
    logged_pool: tuple[asyncpg.Pool, Statements], tenant: Any
) -> None:
    pool, statements = logged_pool
    cache = KeyCache()
    first = asyncio.create_task(authenticate(pool, tenant.key, cache))
    second = asyncio.create_task(authenticate(pool, tenant.key, cache))
    await asyncio.sleep(0)  # both are now waiting on the one lookup
    first.cancel()  # e.g. its client hung up
    assert await second == Principal(
        project_id=tenant.project_id, key_id=tenant.key_id, role=Role.admin
    )
    with pytest.raises(asyncio.CancelledError):
        await first
    assert cache.get(service.hash_key(tenant.key)) is not None
    assert statements.count("SELECT") == 1
    await _touched()
