"""When PostgreSQL has no connection to spare, or the pool waited too long for one, the API
answers a 503 problem with Retry-After, which clients retry; other database errors stay
500s. (Found by bench/pollers.py: with four API processes, PostgreSQL's max_connections ran
out and the error escaped as a dropped connection.)"""

from __future__ import annotations

from collections.abc import Callable

import asyncpg
import httpx
import pytest
import sqlalchemy.exc
from fastapi import FastAPI

from app.core.errors import install_error_handlers


def _app(raise_: Callable[[], None]) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise_()

    return app


def _too_many() -> None:
    raise asyncpg.TooManyConnectionsError("sorry, too many clients already")


def _wrapped_too_many() -> None:
    try:
        _too_many()
    except asyncpg.TooManyConnectionsError as exc:
        raise sqlalchemy.exc.DBAPIError("connect", None, exc) from exc


def _pool_timeout() -> None:
    raise sqlalchemy.exc.TimeoutError("QueuePool limit of size 10 overflow 0 reached")


def _refused() -> None:
    raise ConnectionRefusedError(111, "Connection refused")


def _bad_value() -> None:
    raise asyncpg.DataError("invalid input for query argument $1")


@pytest.mark.parametrize(
    ("raise_", "status"),
    [
        (_too_many, 503),
        (_wrapped_too_many, 503),
        (_pool_timeout, 503),
        (_refused, 503),
        (_bad_value, 500),
    ],
)
async def test_database_unavailability_is_a_retryable_503(
    raise_: Callable[[], None], status: int
) -> None:
    transport = httpx.ASGITransport(app=_app(raise_), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.get("/boom")
    assert r.status_code == status
    assert r.headers["content-type"] == "application/problem+json"
    if status == 503:
        assert r.headers["retry-after"] == "1"
        assert r.json()["title"] == "Service Unavailable"
