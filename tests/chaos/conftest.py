"""The chaos tier: real worker processes (and, where the scenario needs it, a Redis of the
test's own) killed, paused, cut off and restarted mid-run. Selected with ``-m chaos``
(``make test-chaos``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.workers.conftest import (  # noqa: F401  (fixtures)
    idle_system,
    start_worker,
    tiny_model,
    worker_home,
)


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
