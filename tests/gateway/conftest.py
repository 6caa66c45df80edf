"""Gateway runs: the API and the worker in processes of their own, each test on a database
and broker prefix of its own; harnesses on the ``openai`` SDK and the Trainyard SDK."""

from tests.support.api_process import api_server  # noqa: F401  (fixtures)
from tests.support.database import (  # noqa: F401  (fixtures)
    api,
    own_database,
    sessionmaker,
)
from tests.support.workers import (  # noqa: F401  (fixtures)
    start_worker,
    tiny_model,
    tool_model,
    worker_home,
)
