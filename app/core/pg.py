"""A plain asyncpg pool beside SQLAlchemy's, for the API's hottest statements.

``GET /runs/{id}`` and ``POST /runs`` are what every client hammers; through asyncpg
directly they cost a fraction of the CPU of the ORM path (see docs/benchmarks.md). Every
other query goes through SQLAlchemy.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pydantic_core
from sqlalchemy.engine import make_url


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


# pydantic-core's JSON (Rust) costs a fourth of json.dumps' time and a third of json.loads'
# on a run's columns, with the same values back (big integers and non-ASCII text round-trip;
# NaN is refused before anything is stored). It stops at 255 levels of nesting, where the
# standard library goes on: a row stored deeper than that still reads and writes.
def _json_text(value: Any) -> str:
    try:
        return pydantic_core.to_json(value).decode()
    except ValueError:
        return json.dumps(value)


def _json_value(text: str) -> Any:
    try:
        return pydantic_core.from_json(text)
    except ValueError:
        return json.loads(text)


async def init_connection(conn: asyncpg.Connection) -> None:
    for name in ("json", "jsonb"):
        await conn.set_type_codec(
            name, encoder=_json_text, decoder=_json_value, schema="pg_catalog"
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
