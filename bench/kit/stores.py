"""PostgreSQL (asyncpg) and Redis (redis-py), for the harness's own few queries: a
benchmark's database dropped and created beside the admin URL, migrated as an operator
migrates, and its broker keys deleted (never the whole Redis db: others share it)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import time
import urllib.parse
from typing import Any

import asyncpg
import redis

from kit import BenchError, log
from kit.processes import run_checked

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def pg_url_for(admin_url: str, dbname: str, scheme: str = "postgresql") -> str:
    """``admin_url`` pointed at another database, with another scheme (driver)."""
    u = urllib.parse.urlsplit(admin_url)
    return urllib.parse.urlunsplit((scheme, u.netloc, "/" + dbname, "", ""))


_RETURNS_ROWS = re.compile(r"\s*(SELECT|SHOW|WITH|EXPLAIN|VALUES|TABLE)\b", re.I)


def pg_query(url: str, sql: str) -> list[str | None]:
    """Run one statement on a connection of its own; the first column of each row as text.

    Statements that return no rows go through the simple-query protocol, outside any
    transaction block (DROP DATABASE and VACUUM need that)."""
    dsn = re.sub(r"^postgres(?:ql)?\+\w+://", "postgresql://", url)

    async def go() -> list[str | None]:
        try:
            conn = await asyncpg.connect(dsn, timeout=30)
        except (OSError, asyncpg.PostgresError, TimeoutError) as e:
            u = urllib.parse.urlsplit(dsn)
            raise BenchError(f"cannot connect to PostgreSQL at {u.hostname}:{u.port}: {e}") from e
        try:
            if not _RETURNS_ROWS.match(sql):
                await conn.execute(sql)
                return []
            rows = await conn.fetch(sql)
        except asyncpg.PostgresError as e:
            raise BenchError(f"PostgreSQL: {e} (while running: {sql})") from e
        finally:
            await conn.close()
        return [None if r[0] is None else str(r[0]) for r in rows if len(r)]

    return asyncio.run(go())


def pg_json(url: str, sql: str) -> Any:
    """The decoded JSON of a statement that returns one JSON text value (None: no row)."""
    rows = pg_query(url, sql)
    return json.loads(rows[0]) if rows and rows[0] is not None else None


def pg_version(url: str) -> str:
    """The server's version (``SHOW server_version``)."""
    return pg_query(url, "SHOW server_version")[0] or "?"


def recreate_database(admin_url: str, dbname: str) -> None:
    log(f"recreating PostgreSQL database {dbname}")
    drop_database(admin_url, dbname)
    pg_query(admin_url, f'CREATE DATABASE "{dbname}"')


def drop_database(admin_url: str, dbname: str) -> None:
    pg_query(admin_url, f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def migrate(db_url: str, cli: list[str], *, env: dict[str, str] | None = None) -> None:
    """``trainyard db upgrade`` on ``db_url`` (the migrations, as an operator runs them)."""
    env = {**(env or os.environ), "TRAINYARD_DATABASE_URL": db_url}
    name = urllib.parse.urlsplit(db_url).path.lstrip("/")
    run_checked([*cli, "db", "upgrade"], env=env, what=f"migrating {name}")


def redis_ping(url: str) -> None:
    try:
        with redis.Redis.from_url(url, socket_timeout=10) as r:
            r.ping()
    except redis.RedisError as e:
        raise BenchError(f"cannot use Redis at {url}: {e}") from e


def clear_redis_prefix(url: str, prefix: str) -> int:
    """Delete the keys under ``prefix`` (never the whole db: others share it); how many."""
    if not prefix:
        raise BenchError("the broker prefix must not be empty (the Redis db is shared)")
    pattern = re.sub(r"([\\*?\[\]])", r"\\\1", prefix) + "*"
    try:
        with redis.Redis.from_url(url, socket_timeout=10) as r:
            keys = list(r.scan_iter(match=pattern, count=1000))
            return int(r.delete(*keys)) if keys else 0
    except redis.RedisError as e:
        raise BenchError(f"cannot use Redis at {url}: {e}") from e


PG_REFUSED: collections.Counter[str] = collections.Counter()  # harness connections refused


def bench_query(url: str, sql: str, tries: int = 20) -> list[str | None]:
    """pg_query on the bench database, retried while PostgreSQL refuses new connections
    (``too many clients``: the API's pools may hold them all; that is counted and reported)."""
    for attempt in range(tries):
        try:
            return pg_query(url, sql)
        except BenchError as e:
            if "too many clients" not in str(e) or attempt == tries - 1:
                raise
            PG_REFUSED["too many clients"] += 1
            time.sleep(0.5)
    raise AssertionError("unreachable")
