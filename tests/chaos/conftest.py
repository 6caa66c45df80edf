"""The chaos tier: real worker processes (and, where the scenario needs it, a Redis of the
test's own) killed, paused, cut off and restarted mid-run. Selected with ``-m chaos``
(``make test-chaos``). Each test runs on a database and broker prefix of its own."""

from __future__ import annotations

from tests.support.broker import own_redis  # noqa: F401  (fixtures)
from tests.support.database import api, own_database, sessionmaker  # noqa: F401  (fixtures)
from tests.support.llm import llm, llm_server  # noqa: F401  (fixtures)
from tests.support.workers import start_worker, tiny_model, worker_home  # noqa: F401  (fixtures)
