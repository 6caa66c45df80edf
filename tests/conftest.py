"""Test fixtures on the real thing: PostgreSQL and Redis from ``TRAINYARD_DATABASE_URL`` /
``TRAINYARD_REDIS_URL`` (CI sets them to the machine's servers), embedded ones otherwise.

Each test session migrates a fresh database of its own and drops it at the end; each test
makes its own project and key, so tests never see each other's runs. Tests that start worker
processes get a database of their own on top (tests/support/database.py). Helpers shared by
tests live in tests/support, never here.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.core.settings import get_settings
from tests.support import ROOT
from tests.support.database import (
    Tenant,
    TenantMaker,
    app_on,
    client_of,
    delete_broker_keys,
    execute,
    new_tenant,
    sessions_on,
    template_of,
)

# The suite's runs name test code (tests.support…), local MCP servers and fake judges, as
# one person's `trainyard up` may: the `open` code policy, for this process and every API
# and worker process the tests start. Tests of the `catalog` policy (tests/catalog) and the
# chaos fuzz set their own.
os.environ.setdefault("TRAINYARD_CODE_POLICY", "open")

# Under pytest-xdist (`make test`) the processes share the machine's cores: each, and every
# worker and API it starts, gets its share of torch's OpenMP threads. Two processes with a
# thread per core each made some training tests 3-6x slower than alone.
if _xdist_workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(_xdist_workers)))
    )

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


#: How much of each process log a failing test's report shows.
_LOG_TAIL = 6000


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failing test shows the end of each log its processes wrote (the API's, each
    worker's: ``*.log`` in its ``tmp_path``): a 500 in CI is otherwise a dead end."""
    report = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and call.when != "teardown" and isinstance(tmp, Path):
        for log in sorted(tmp.glob("*.log")):
            text = log.read_text(errors="replace")
            report.sections.append(
                (f"{log.name} (its last {_LOG_TAIL} characters)", text[-_LOG_TAIL:])
            )
    return report


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


@pytest.fixture(scope="session")
def service_urls() -> Iterator[tuple[str, str]]:
    """(database URL of a fresh migrated database, broker URL), for the whole session.

    Right after the migration, before anything connects to it, the database is copied into a
    template that ``own_database`` (tests/support/database.py) clones for the tests that run
    worker processes."""
    import asyncio

    home = Path(os.environ.get("TRAINYARD_TEST_HOME", ROOT / ".trainyard" / "test"))
    # Under pytest-xdist (`make test`) each process is a session of its own: embedded servers
    # of its own too, or the first session to finish would stop the other's.
    home /= os.environ.get("PYTEST_XDIST_WORKER", "")
    base_db, broker, started = _base_urls(home)
    name = f"trainyard_test_{uuid.uuid4().hex[:8]}"
    template = template_of(name)

    asyncio.run(execute(base_db, f'CREATE DATABASE "{name}"'))
    db_url = make_url(base_db).set(database=name).render_as_string(hide_password=False)
    os.environ["TRAINYARD_DATABASE_URL"] = db_url
    os.environ["TRAINYARD_REDIS_URL"] = broker
    os.environ.setdefault("TRAINYARD_HOME", str(home))
    # Queues of their own, so test sessions sharing one Redis never take each other's tasks.
    os.environ["TRAINYARD_BROKER_PREFIX"] = f"{name}:"
    get_settings.cache_clear()

    from app.cli.db import upgrade

    upgrade(db_url)
    asyncio.run(execute(base_db, f'CREATE DATABASE "{template}" TEMPLATE "{name}"'))
    try:
        yield db_url, broker
    finally:
        for database in (name, template):
            asyncio.run(execute(base_db, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        # The session's name starts every own_database's prefix too: this sweeps them all.
        delete_broker_keys(broker, name)
        for service in started:  # embedded servers this session started
            service.stop()


@pytest.fixture(scope="session")
async def sessionmaker(
    service_urls: tuple[str, str],
) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    async with sessions_on(service_urls[0]) as maker:
        yield maker


@pytest.fixture
async def session(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    async with sessionmaker() as s:
        yield s


@pytest.fixture(scope="session")
async def api(service_urls: tuple[str, str]) -> AsyncIterator[Any]:
    """The real app with its lifespan run (engine, broker connection, key cache)."""
    async with app_on(get_settings()) as application:
        yield application


@pytest.fixture
async def client(api: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with client_of(api) as c:
        yield c


@pytest.fixture
def make_tenant(sessionmaker: async_sessionmaker[AsyncSession]) -> TenantMaker:
    return functools.partial(new_tenant, sessionmaker)


@pytest.fixture
async def tenant(make_tenant: TenantMaker) -> Tenant:
    return await make_tenant()
