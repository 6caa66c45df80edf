"""Tenants, and a database of a test's own.

The session migrates one database and copies it, untouched, into a template
(:func:`template_of`). A test that starts real worker processes takes ``own_database``: a
clone of that template (a file copy, fast) and a broker prefix of its own, both dropped at
the end. Its workers' reconciler sweeps every run of the database it is given, so there it
sees only the test's runs: nothing another test left pending, and nobody needs to cancel
anything for it.

The conftests of tests/workers, tests/chaos and tests/vllm import the fixtures below, which
put ``sessionmaker`` and ``api`` (and through them ``client``, ``make_tenant``, ``tenant``
and ``session``) on that database.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import pytest
import redis
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.core.db import make_engine, make_sessionmaker
from app.core.pg import connect_kwargs
from app.core.settings import Settings, get_settings

Maker = async_sessionmaker[AsyncSession]


def template_of(database: str) -> str:
    """The name of the template copied from the session's freshly migrated ``database``."""
    return f"{database}_tmpl"


async def execute(url: str, sql: str) -> None:
    """One statement on its own connection to the database of ``url`` (CREATE/DROP
    DATABASE cannot run in a transaction)."""
    conn = await asyncpg.connect(**connect_kwargs(url))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def delete_broker_keys(broker_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(broker_url.replace("redis+socket://", "unix://"))
    try:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
    finally:
        client.close()


@asynccontextmanager
async def sessions_on(url: str, pool_size: int = 20) -> AsyncIterator[Maker]:
    engine = make_engine(url, pool_size=pool_size)
    try:
        yield make_sessionmaker(engine)
    finally:
        await engine.dispose()


@asynccontextmanager
async def app_on(settings: Settings) -> AsyncIterator[Any]:
    """The real app with its lifespan run (engine, broker connection, key cache)."""
    from app.main import create_app

    application = create_app(settings)
    async with application.router.lifespan_context(application):
        yield application


@asynccontextmanager
async def client_of(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


class Tenant:
    """A project with one API key, as a test sees it."""

    def __init__(
        self, project_id: uuid.UUID, name: str, key: str, key_id: uuid.UUID, role: str = "admin"
    ) -> None:
        self.project_id = project_id
        self.name = name
        self.key = key
        self.key_id = key_id
        self.role = role
        self.headers = {"Authorization": f"Bearer {key}"}


async def new_tenant(maker: Maker, name: str | None = None, *, role: str = "admin") -> Tenant:
    """A committed project (``name``, or a fresh one; an existing one gets one more key) with
    one new API key of ``role`` (admin by default: a test reaches every route unless it is
    about roles)."""
    from app.auth.roles import Role
    from app.auth.service import create_key, get_or_create_project

    name = name or f"proj-{uuid.uuid4().hex[:8]}"
    async with maker() as s:
        project = await get_or_create_project(s, name)
        key, plain = await create_key(s, project, role=Role(role))
        await s.commit()
    return Tenant(project.id, name, plain, key.id, role)


TenantMaker = Callable[..., Awaitable[Tenant]]


@dataclass(frozen=True)
class OwnDatabase:
    """A test's own database and broker prefix, and the settings that point at them."""

    url: str
    broker_url: str
    broker_prefix: str
    settings: Settings

    def env(self) -> dict[str, str]:
        """What a process started by the test needs to use them (workers, the API)."""
        return {
            "TRAINYARD_DATABASE_URL": self.url,
            "TRAINYARD_REDIS_URL": self.broker_url,
            "TRAINYARD_BROKER_PREFIX": self.broker_prefix,
        }


@contextlib.asynccontextmanager
async def database_of_its_own(service_urls: tuple[str, str]) -> AsyncIterator[OwnDatabase]:
    """A database cloned from the template, and a broker prefix, dropped afterwards."""
    session_url, broker = service_urls
    session_db = make_url(session_url).database
    assert session_db
    name = f"{session_db}_{uuid.uuid4().hex[:8]}"
    # Connected to the session's database: the template itself must have no connection.
    await execute(session_url, f'CREATE DATABASE "{name}" TEMPLATE "{template_of(session_db)}"')
    url = make_url(session_url).set(database=name).render_as_string(hide_password=False)
    prefix = f"{name}:"
    settings = get_settings().model_copy(update={"database_url": url, "broker_prefix": prefix})
    try:
        yield OwnDatabase(url, broker, prefix, settings)
    finally:
        await execute(session_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        delete_broker_keys(broker, prefix)


@pytest.fixture
async def own_database(service_urls: tuple[str, str]) -> AsyncIterator[OwnDatabase]:
    async with database_of_its_own(service_urls) as own:
        yield own


@pytest.fixture(scope="module")
async def module_database(service_urls: tuple[str, str]) -> AsyncIterator[OwnDatabase]:
    """One database for a module whose tests share a long-lived service (``trainyard up``):
    no worker of it ever sees another module's runs."""
    async with database_of_its_own(service_urls) as own:
        yield own


@pytest.fixture
async def sessionmaker(own_database: OwnDatabase) -> AsyncIterator[Maker]:
    async with sessions_on(own_database.url, pool_size=5) as maker:
        yield maker


@pytest.fixture
async def api(own_database: OwnDatabase) -> AsyncIterator[Any]:
    async with app_on(own_database.settings) as application:
        yield application
