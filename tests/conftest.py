"""Test fixtures on the real thing: PostgreSQL and Redis from ``TRAINYARD_DATABASE_URL`` /
``TRAINYARD_REDIS_URL`` (CI sets them to the machine's servers), embedded ones otherwise.

Each test session migrates a fresh database of its own and drops it at the end; each test
makes its own project and key, so tests never see each other's runs.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import redis
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.core.db import make_engine, make_sessionmaker
from app.core.settings import get_settings

ROOT = Path(__file__).resolve().parent.parent

# Modules that cost seconds to collect, collected only when ``-m`` can select their marker:
# Schemathesis builds every operation's coverage cases while the fuzz is being collected.
_COLLECTED_ONLY_WITH_MARK = {ROOT / "tests" / "chaos" / "test_openapi_fuzz.py": "chaos"}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    mark = _COLLECTED_ONLY_WITH_MARK.get(collection_path)
    if mark is None or not config.option.markexpr:
        return None
    from _pytest.mark.expression import Expression

    selected = Expression.compile(config.option.markexpr).evaluate(lambda name, **_: name == mark)
    return True if not selected else None


def _base_urls(tmp_home: Path) -> tuple[str, str, list[Any]]:
    """The configured URLs, or embedded servers (and the ones this session started)."""
    db = os.environ.get("TRAINYARD_DATABASE_URL")
    broker = os.environ.get("TRAINYARD_REDIS_URL")
    started: list[Any] = []
    if not db or not broker:
        from app.core.embedded import start_postgres, start_redis

        for name, url, start in (("db", db, start_postgres), ("broker", broker, start_redis)):
            if url:
                continue
            service = start(tmp_home)
            if service.started:
                started.append(service)
            if name == "db":
                db = service.url
            else:
                broker = service.url
    assert db and broker
    return db, broker, started


def _asyncpg_dsn(url: str) -> dict[str, Any]:
    from app.core.pg import connect_kwargs

    return connect_kwargs(url)


@pytest.fixture(scope="session")
def service_urls() -> Iterator[tuple[str, str]]:
    """(database URL of a fresh migrated database, broker URL), for the whole session."""
    import asyncio

    home = Path(os.environ.get("TRAINYARD_TEST_HOME", ROOT / ".trainyard" / "test"))
    base_db, broker, started = _base_urls(home)
    name = f"trainyard_test_{uuid.uuid4().hex[:8]}"
    admin = _asyncpg_dsn(base_db)

    async def _admin(sql: str) -> None:
        conn = await asyncpg.connect(**admin)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    db_url = make_url(base_db).set(database=name).render_as_string(hide_password=False)
    os.environ["TRAINYARD_DATABASE_URL"] = db_url
    os.environ["TRAINYARD_REDIS_URL"] = broker
    os.environ.setdefault("TRAINYARD_HOME", str(home))
    # Queues of their own, so test sessions sharing one Redis never take each other's tasks.
    os.environ["TRAINYARD_BROKER_PREFIX"] = f"{name}:"
    get_settings.cache_clear()

    from app.cli import _upgrade

    _upgrade(db_url)
    try:
        yield db_url, broker
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        client = redis.Redis.from_url(broker.replace("redis+socket://", "unix://"))
        for key in client.scan_iter(f"{name}:*"):
            client.delete(key)
        for service in started:  # embedded servers this session started
            service.stop()


@pytest.fixture(scope="session")
async def sessionmaker(
    service_urls: tuple[str, str],
) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = make_engine(service_urls[0], pool_size=20)
    yield make_sessionmaker(engine)
    await engine.dispose()


@pytest.fixture
async def session(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    async with sessionmaker() as s:
        yield s


@pytest.fixture(scope="session")
async def api(service_urls: tuple[str, str]) -> AsyncIterator[Any]:
    """The real app with its lifespan run (engine, broker connection, key cache)."""
    from app.main import create_app

    application = create_app(get_settings())
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def client(api: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


class Tenant:
    """A project with one API key, as a test sees it."""

    def __init__(self, project_id: uuid.UUID, name: str, key: str, key_id: uuid.UUID) -> None:
        self.project_id = project_id
        self.name = name
        self.key = key
        self.key_id = key_id
        self.headers = {"Authorization": f"Bearer {key}"}


@pytest.fixture
def make_tenant(sessionmaker: async_sessionmaker[AsyncSession]) -> Any:
    from app.auth.service import create_key, get_or_create_project

    async def _make(name: str | None = None) -> Tenant:
        name = name or f"proj-{uuid.uuid4().hex[:8]}"
        async with sessionmaker() as s:
            project = await get_or_create_project(s, name)
            key, plain = await create_key(s, project)
            await s.commit()
        return Tenant(project.id, name, plain, key.id)

    return _make


@pytest.fixture
async def tenant(make_tenant: Any) -> Tenant:
    return await make_tenant()


def run_body(**overrides: Any) -> dict[str, Any]:
    """A valid run-create body (function reward, two inline inputs)."""
    body: dict[str, Any] = {
        "model_name": "tiny-llama",
        "task_description": "Answer with the letter a.",
        "inputs": [{"input_text": "say a"}, {"input_text": "say aa"}],
        "reward": {
            "type": "function",
            "functions": [{"name": "char_fraction", "args": {"char": "a"}}],
        },
    }
    body.update(overrides)
    return body
