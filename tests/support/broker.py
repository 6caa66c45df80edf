"""A Redis of a test's own, for the tests that stop, restart and flush the broker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


class OwnRedis:
    """An embedded Redis only this test uses, so it can be stopped, restarted and flushed
    without touching the Redis other test sessions share."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.service: Any = None
        self.url = ""

    def start(self) -> None:
        from app.core.embedded import start_redis

        self.service = start_redis(self.home)
        self.url = self.service.url

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url.replace("redis+socket://", "unix://"))


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path / "redis-home")
    server.start()
    try:
        yield server
    finally:
        server.stop()
