"""Embedded PostgreSQL/Redis: reachable by trainyard's clients, reusable, stoppable, crash-safe."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from app.core.embedded import (
    EmbeddedService,
    redis_py_url,
    start_postgres,
    start_redis,
    stop_all,
)
from app.core.ratelimit import RateLimiter
from app.health import broker_client

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "data"
    yield path
    stop_all(path)  # never leave servers behind, whatever the test did


def _alive(pid: int) -> bool:
    """Zombie-aware: where PID 1 does not reap, a stopped daemon lingers as a zombie."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _pg_query(url: str) -> list[tuple[object, ...]]:
    async def run() -> list[tuple[object, ...]]:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return list((await conn.execute(text("SELECT current_database(), 1"))).all())
        finally:
            await engine.dispose()

    return asyncio.run(run())


def _redis_client(url: str) -> redis.Redis:
    assert url.startswith("redis+socket:///")
    return redis.Redis.from_url(redis_py_url(url), socket_timeout=5)


def _unrelated_process() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def test_postgres_start_reuse_stop(data_dir: Path) -> None:
    pg = start_postgres(data_dir)
    assert pg.started and pg.pid is not None and _alive(pg.pid)
    assert pg.url.startswith("postgresql+asyncpg://")
    assert _pg_query(pg.url) == [("trainyard", 1)]

    again = start_postgres(data_dir)
    assert (again.started, again.pid, again.url) == (False, pg.pid, pg.url)

    pg.stop()
    assert not _alive(pg.pid)
    pg.stop()  # second stop is a no-op


def test_redis_start_reuse_stop(data_dir: Path) -> None:
    rd = start_redis(data_dir)
    assert rd.started and rd.pid is not None and _alive(rd.pid)
    client = _redis_client(rd.url)
    assert client.ping()
    client.close()

    again = start_redis(data_dir)
    assert (again.started, again.pid, again.url) == (False, rd.pid, rd.url)

    rd.stop()
    assert not _alive(rd.pid)
    rd.stop()


def test_restart_after_crash_with_recycled_pids(data_dir: Path) -> None:
    pg, rd = start_postgres(data_dir), start_redis(data_dir)
    assert pg.pid is not None and rd.pid is not None
    os.kill(pg.pid, signal.SIGKILL)
    os.kill(rd.pid, signal.SIGKILL)
    # Worst case after a crash or reboot: the pid files name a live process that is not ours.
    squatter = _unrelated_process()
    try:
        for pidfile in (data_dir / "pg" / "postmaster.pid", data_dir / "redis" / "redis.pid"):
            lines = pidfile.read_text().split("\n")
            pidfile.write_text("\n".join([str(squatter.pid), *lines[1:]]))

        pg2, rd2 = start_postgres(data_dir), start_redis(data_dir)
        assert pg2.started and rd2.started
        assert pg2.pid not in (pg.pid, squatter.pid) and rd2.pid not in (rd.pid, squatter.pid)
        assert _pg_query(pg2.url) == [("trainyard", 1)]
        assert _redis_client(rd2.url).ping()

        # A stale handle must not signal whatever now owns its pid.
        EmbeddedService("postgres", pg.url, squatter.pid, True, pg.workdir).stop()
        EmbeddedService("redis", rd.url, squatter.pid, True, rd.workdir).stop()
        assert squatter.poll() is None
    finally:
        squatter.kill()
        squatter.wait()


def test_servers_outlive_the_process_that_started_them(data_dir: Path) -> None:
    script = (
        "import sys; from pathlib import Path\n"
        "from app.core.embedded import start_postgres, start_redis\n"
        "d = Path(sys.argv[1]); print(start_postgres(d).pid, start_redis(d).pid)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(data_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    pg_pid, redis_pid = map(int, out.split())

    pg, rd = start_postgres(data_dir), start_redis(data_dir)
    assert (pg.started, pg.pid) == (False, pg_pid)
    assert (rd.started, rd.pid) == (False, redis_pid)

    stop_all(data_dir)
    assert not _alive(pg_pid) and not _alive(redis_pid)


def test_deep_data_dir_uses_short_socket_dir(data_dir: Path) -> None:
    deep = data_dir / ("d" * 60) / ("e" * 60)
    socket_dirs: list[Path] = []
    try:
        pg = start_postgres(deep)
        socket_dirs.append(Path(str(make_url(pg.url).query["host"])))
        rd = start_redis(deep)
        socket_dirs.append(Path(rd.url.removeprefix("redis+socket://")).parent)
        assert [d.parent for d in socket_dirs] == [Path("/tmp"), Path("/tmp")]
        assert _pg_query(pg.url) == [("trainyard", 1)]
        assert _redis_client(rd.url).ping()
    finally:
        stop_all(deep)
        for socket_dir in socket_dirs:
            shutil.rmtree(socket_dir, ignore_errors=True)
    assert pg.pid is not None and not _alive(pg.pid)
    assert rd.pid is not None and not _alive(rd.pid)


def test_redis_py_reads_the_url_the_broker_takes() -> None:
    assert redis_py_url("redis+socket:///tmp/ty/redis.sock") == "unix:///tmp/ty/redis.sock"
    for other in ("redis://cache:6380/1", "rediss://cache", "unix:///run/redis.sock?db=2"):
        assert redis_py_url(other) == other


def test_the_limiter_and_readyz_reach_the_embedded_redis(data_dir: Path) -> None:
    """Celery's ``redis+socket://`` spelling, which start_redis hands out, works for the
    API's own Redis clients too."""
    rd = start_redis(data_dir)

    async def scenario() -> tuple[bool, int | None]:
        limiter = RateLimiter(rd.url, rate=0.001, burst=3)
        ready = broker_client(rd.url)
        try:
            decision = await limiter.hit("embedded")
            return bool(await ready.ping()), decision.remaining if decision else None
        finally:
            await limiter.aclose()
            await ready.aclose()

    assert asyncio.run(scenario()) == (True, 2)
