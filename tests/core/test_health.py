"""/readyz pings PostgreSQL and the broker's Redis directly, each within READY_TIMEOUT, and
the API needs nothing of Celery (or of workers/) for it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from app import health
from app.core.db import make_engine

ROOT = Path(__file__).resolve().parents[2]
CLOSED_PORT_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1

Ready = Callable[[str], AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def ready_client(service_urls: tuple[str, str]) -> Ready:
    """``async with ready_client(broker_url) as client``: the health routes with the state
    the API's lifespan gives them, the session's database and the given broker."""

    @asynccontextmanager
    async def _client(broker: str) -> AsyncIterator[httpx.AsyncClient]:
        app = FastAPI()
        app.include_router(health.router)
        app.state.engine = make_engine(service_urls[0], pool_size=1)
        app.state.redis = health.broker_client(broker)
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                yield c
        finally:
            await app.state.redis.aclose()
            await app.state.engine.dispose()

    return _client


async def test_ready_when_both_answer(ready_client: Ready, service_urls: tuple[str, str]) -> None:
    async with ready_client(service_urls[1]) as client:
        for _ in range(2):  # the second ping reuses the connection
            r = await client.get("/readyz")
            assert r.status_code == 200, r.text
            assert r.json() == {"status": "ok", "checks": {"database": "ok", "broker": "ok"}}


async def test_a_broker_that_refuses_is_503_at_once(ready_client: Ready) -> None:
    async with ready_client(CLOSED_PORT_REDIS) as client:
        r = await client.get("/readyz")
    assert r.status_code == 503
    assert r.json() == {
        "status": "unavailable",
        "checks": {"database": "ok", "broker": "error: ConnectionError"},
    }


async def test_a_broker_that_never_answers_is_503_within_the_timeout(
    ready_client: Ready, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "READY_TIMEOUT", 0.3)
    heard: list[bytes] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heard.append(await reader.read(100))  # accepts, reads the first command, never answers
        await reader.read()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with ready_client(f"redis://127.0.0.1:{port}/0") as client:
            # Only turns a hang into a failure: the broker never answers, so any answer at
            # all means the check gave up on its own, and the error says it timed out.
            async with asyncio.timeout(30):
                r = await client.get("/readyz")
    finally:
        server.close()
    assert r.status_code == 503
    assert r.json()["checks"] == {"database": "ok", "broker": "error: TimeoutError"}
    # The client connected and spoke (HELLO, then PING): a timeout, not a refused connection.
    assert heard and heard[0].startswith(b"*")


def test_health_and_the_rate_limiter_import_nothing_of_celery_or_workers() -> None:
    code = (
        "import sys, app.health, app.core.ratelimit, app.auth.deps\n"
        "roots = {m.split('.')[0] for m in sys.modules}\n"
        "bad = sorted(roots & {'celery', 'kombu', 'workers'})\n"
        "print(' '.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == ""
