"""Real Celery worker processes (``trainyard worker``) for lease and reconciler tests and the
real pipeline, each test on a database and broker prefix of its own."""

from tests.support.database import api, own_database, sessionmaker  # noqa: F401  (fixtures)
from tests.support.llm import llm, llm_server  # noqa: F401  (fixtures)
from tests.support.workers import (  # noqa: F401  (fixtures)
    start_worker,
    tiny_model,
    tool_model,
    worker_home,
)
