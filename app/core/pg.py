"""A plain asyncpg pool beside SQLAlchemy's, for the API's hottest statements.

``GET /runs/{id}`` and ``POST /runs`` are what every client hammers; through asyncpg
directly they cost a fraction of the CPU of the ORM path (see docs/benchmarks.md). Every
other query goes through SQLAlchemy.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from app.core import jsontext


def connect_kwargs(url: str) -> dict[str, Any]:
    """asyncpg.connect() arguments for a SQLAlchemy URL (TCP or ``?host=/socket/dir``)."""
    u = make_url(url)
    kwargs: dict[str, Any] = {
        "user": u.username or "postgres",
        "database": u.database,
        "host": u.query.get("host") or u.host,
    }
    if u.port:
        kwargs["port"] = u.port
    if u.password:
        kwargs["password"] = u.password
    return kwargs


async def init_connection(conn: asyncpg.Connection) -> None:
    for name in ("json", "jsonb"):
        # app.core.jsontext: pydantic-core's JSON, a fourth of the standard library's time.
        await conn.set_type_codec(
            name, encoder=jsontext.dumps, decoder=jsontext.loads, schema="pg_catalog"
        )


async def keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset: nothing beyond what asyncpg always does (forget the listeners,
    roll back a transaction left open). Its default also sends ``RESET ALL; UNLISTEN *;
    CLOSE ALL`` and an advisory unlock on every release, a round trip per request; nothing
    here leaves session state on a pool connection (advisory locks are transaction-scoped,
    LISTEN has connections of its own, nothing SETs a session variable)."""


async def create_pool(url: str, *, size: int, name: str = "trainyard-api") -> asyncpg.Pool:
    return await asyncpg.create_pool(
        **connect_kwargs(url),
        min_size=1,
        max_size=size,
        init=init_connection,
        reset=keep_session,
        server_settings={"application_name": name},
    )
